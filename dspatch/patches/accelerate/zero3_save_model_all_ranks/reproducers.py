"""Reproducers: a 2-rank torchrun job of this module (gloo, CPU): accelerate prepares a tiny Llama at ZeRO-3
(gathering 16-bit weights on save), trains one step, and every rank calls `accelerator.save_model`, as it must.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import os

from dspatch.patches.accelerate.zero3_save_model_all_ranks import NONE_ITEMS
from dspatch.spec import BugSeen, Proof


def _job(folder):
    import logging
    import traceback

    import torch

    from dspatch.scenario import finish_rank, gathered_whole, init_deepspeed, settle, tiny_llama

    deepspeed = init_deepspeed()
    settle()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = tiny_llama()
    engine, _ = accelerator.prepare(model, DummyOptim(model.parameters()))
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(engine(input_ids=ids, labels=ids).loss)
    engine.empty_partition_cache()  # a prefetch still in flight would be read before it arrives (GatheredParameters)
    trained = gathered_whole(engine.module.named_parameters())  # a collective: every rank
    out = os.path.join(folder, "saved")
    result = {"rank": accelerator.process_index, "world": accelerator.num_processes}
    try:
        accelerator.save_model(engine, out)
        result["returned"] = True
    except AttributeError as e:
        if NONE_ITEMS not in str(e):
            raise
        traceback.print_exc()  # upstream's own traceback, as a user's log shows it
        result["error"] = f"AttributeError: {e}"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        from safetensors.torch import load_file

        files = sorted(os.listdir(out)) if os.path.isdir(out) else []
        result["files"] = files
        saved = load_file(os.path.join(out, "model.safetensors")) if "model.safetensors" in files else {}
        result["equal"] = set(saved) == set(trained) and all(torch.equal(saved[n], trained[n]) for n in saved)
    finish_rank(folder, result)


def save_model_on_every_rank():
    """2 ranks at ZeRO-3, save_model called on both: both return, rank 0 writes model.safetensors, and the
    weights written equal the gathered model's."""
    from dspatch.scenario import launch_ranks

    ranks = launch_ranks(__name__)
    if [r["world"] for r in ranks] != [2, 2]:
        raise AssertionError(f"accelerate did not run 2 ranks: {ranks}")
    failed = [r for r in ranks if "error" in r]
    if failed:
        raise BugSeen("; ".join(f"rank {r['rank']}: Accelerator.save_model at ZeRO-3: {r['error']}" for r in failed))
    main = ranks[0]
    if main["files"] != ["model.safetensors"] or not main["equal"]:
        raise AssertionError(f"rank 0 wrote {main['files']}, weights equal to the gathered model: {main['equal']}")


PROOF = Proof(
    scenarios={"save_model_on_every_rank": save_model_on_every_rank},
    expected_on_stock={"save_model_on_every_rank": f"rank 1: Accelerator.save_model at ZeRO-3: AttributeError: {NONE_ITEMS}"},
    # The releases of accelerate that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.20.0", "1.2.0"),
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1])
