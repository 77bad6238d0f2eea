"""Reproducers: the real Trainer on a tiny Llama (hidden size 32: 0.9 * 32 * 32 = 921.6) with the documented ZeRO-3
config whose sizes are "auto", one training step on the CPU.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.patches.transformers.deepspeed_prefetch_bucket_int import REFUSED
from dspatch.spec import BugSeen, Proof


def auto_zero3_config_trains():
    """The Trainer with ZeRO-3 and "auto" bucket sizes starts and trains a step; DeepSpeed got the integer
    int(0.9 * hidden * hidden) as its prefetch bucket size."""
    import tempfile

    import torch

    from dspatch.scenario import init_deepspeed, reset_accelerate, tiny_llama

    init_deepspeed()
    from transformers import Trainer, TrainingArguments

    reset_accelerate()
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    ids = torch.randint(4, 64, (4, 8), generator=torch.Generator().manual_seed(1)).tolist()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1, report_to=[],
                                 save_strategy="no", deepspeed=config, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
        try:
            trainer.train()
        except Exception as e:  # pydantic's ValidationError, raised by deepspeed.initialize
            if REFUSED not in str(e) or "stage3_prefetch_bucket_size" not in str(e):
                raise
            raise BugSeen(f"deepspeed.initialize refused the Trainer's \"auto\" ZeRO-3 config: {type(e).__name__}: "
                          f"stage3_prefetch_bucket_size: {REFUSED}") from e
        finally:
            reset_accelerate()
        filled = args.hf_deepspeed_config.config["zero_optimization"]  # what the Trainer filled "auto" with
        bucket, wanted = filled["stage3_prefetch_bucket_size"], int(0.9 * 32 * 32)
        if bucket != wanted or type(bucket) is not int:
            raise AssertionError(f"the Trainer filled stage3_prefetch_bucket_size with {bucket!r}, wanted {wanted}")


PROOF = Proof(
    scenarios={"auto_zero3_config_trains": auto_zero3_config_trains},
    expected_on_stock={"auto_zero3_config_trains": "refused the Trainer's \"auto\" ZeRO-3 config: ValidationError"},
    # The releases of transformers that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("4.36.0", "4.46.0"),
    # A version of each package the patch `requires` with the bug's need, and one without (release suite).
    others_with_and_without=({"deepspeed": "0.16.3"}, {"deepspeed": "0.14.4"}),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("tf444_ds16",),
)
