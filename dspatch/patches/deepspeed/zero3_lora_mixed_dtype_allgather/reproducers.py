"""Reproducers: a 2-rank job of this module (gloo, CPU): a tiny Llama built in bf16 under `zero.Init`, PEFT's LoRA on
its attention projections (fp32 adapters, PEFT's default on a bf16 base), bf16 ZeRO-3 with the default persistence
threshold (every small parameter persistent, as LoRA matrices and norms are in real models), SGD on the adapters,
two steps of `engine.backward(loss); engine.step()`.

A failure, not a wrong number: stock stops at the first step, where ZeRO-3 gathers the persistent parameters. Fixed,
both steps run on both ranks, with finite losses, and adapters that moved and are still fp32 (gathered one at a
time). Any other failure is an error, not this bug.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, LR = 2, 0.5
MESSAGES = ("output tensor must have the same type as input tensor", "ProcessGroupGloo::allgather: invalid tensor type")


def _job(folder, mode="lora"):
    import traceback

    import torch

    from dspatch.scenario import finish_rank, gathered_whole, init_deepspeed, lm_batches, lm_loss, on_accelerator
    from dspatch.scenario import settle, tiny_llama

    deepspeed = init_deepspeed()
    settle()
    from peft import LoraConfig, get_peft_model

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        base = tiny_llama()
    if mode == "lora":
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0))
    else:  # "bf16": the base alone, every parameter trained (one dtype: nothing for the fix to do)
        model = base
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(list(adapters.values()), lr=LR),
                                      config=config)
    before = gathered_whole(adapters.items())
    losses, error = [], None
    try:
        for batch in lm_batches(STEPS):
            loss = lm_loss(engine, {key: on_accelerator(value) for key, value in batch.items()})
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    except (TypeError, RuntimeError) as e:
        if not any(message in str(e) for message in MESSAGES):
            raise
        traceback.print_exc()  # upstream's traceback, as the job's log shows it
        error = f"{type(e).__name__}: {e}"
    from dspatch import _runtime

    result = {"dtypes": dtypes, "losses": losses, "error": error, "applied": _runtime.applied_ids()}
    if error is None:
        after = gathered_whole(adapters.items())
        result.update(moved=sum(not torch.equal(before[n], after[n]) for n in after), count=len(after),
                      adapter_dtypes=sorted({str(adapters[n].dtype) for n in adapters}),
                      digest={n: after[n].float().sum().item() for n in after})
    finish_rank(folder, result)


def run(mode="lora"):
    """The ranks' results of the 2-rank job: "lora" (fp32 adapters on the bf16 base) or "bf16" (the base alone)."""
    from dspatch.scenario import launch_ranks

    return launch_ranks(__name__, args=(mode,))


def lora_bf16_zero3():
    """bf16 ZeRO-3 with LoRA's fp32 adapters on a bf16 base, 2 ranks: both steps train."""
    import math

    ranks = run()
    if any(r["dtypes"] != ["torch.bfloat16", "torch.float32"] for r in ranks):  # the run is the one meant
        raise AssertionError(f"the model's dtypes are {ranks[0]['dtypes']}, not a bf16 base with fp32 adapters")
    errors = [r["error"] for r in ranks if r["error"]]
    if errors:
        raise BugSeen(f"ZeRO-3 with fp32 LoRA adapters on a bf16 base: the persistent parameters' all-gather fails "
                      f"at the first step: {errors[0]}")
    # (not compared across ranks: without deepspeed/zero3-gather-waits-all, 0.19.2's gather of the persistent
    # parameters may read one early on gloo, a bug of its own)
    if not all(len(r["losses"]) == STEPS and all(map(math.isfinite, r["losses"])) and r["moved"] == r["count"] > 0
               and r["adapter_dtypes"] == ["torch.float32"] for r in ranks):
        raise AssertionError(f"the job ran but did not train as it should: {ranks}")


PROOF = Proof(
    scenarios={"lora_bf16_zero3": lora_bf16_zero3},
    expected_on_stock={"lora_bf16_zero3": "the persistent parameters' all-gather fails"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.19.1", "0.19.3"),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0192",),
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1], *sys.argv[2:])
