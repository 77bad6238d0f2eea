"""Reproducers: a real Accelerator with the DeepSpeed plugin (ZeRO-2, CPU, one process) and a WarmupLR block whose
values are "auto", given a `DummyScheduler` without warmup (its default), three SGD steps of a custom loop.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import re

from dspatch.patches.accelerate.deepspeed_warmup_zero import REFUSED
from dspatch.spec import BugSeen, Proof

STEPS = 3


def _rates(warmup):
    """The learning rate of the optimizer after each of STEPS steps with `DummyScheduler(warmup_num_steps=warmup)`."""
    import torch

    from dspatch.scenario import init_deepspeed, lm_batches, reset_accelerate, tiny_llama

    init_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyScheduler

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2},
              "scheduler": {"type": "WarmupLR",
                            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    reset_accelerate()
    try:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        model = tiny_llama()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, optimizer, scheduler = accelerator.prepare(model, optimizer, DummyScheduler(optimizer,
                                                                                            warmup_num_steps=warmup))
        rates = []
        for batch in lm_batches(STEPS):
            accelerator.backward(engine(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            rates.append(optimizer.param_groups[0]["lr"])
    finally:
        reset_accelerate()
    return rates


def dummy_scheduler_without_warmup_trains():
    """A DummyScheduler without warmup and an "auto" WarmupLR train, at the rates of one warmup step."""
    try:
        rates = _rates(0)
    except ValueError as e:
        if not re.search(REFUSED, str(e)):
            raise
        raise BugSeen(f"deepspeed.initialize refused accelerate's \"auto\" warmup: ValueError: {e}") from e
    wanted = _rates(1)
    if rates != wanted:
        raise AssertionError(f"learning rates {rates}, those of one warmup step {wanted}")


PROOF = Proof(
    scenarios={"dummy_scheduler_without_warmup_trains": dummy_scheduler_without_warmup_trains},
    expected_on_stock={"dummy_scheduler_without_warmup_trains": "refused accelerate's \"auto\" warmup: ValueError: "
                                                                "warmup_num_steps must be a positive integer, got 0"},
    releases_checked=("0.34.0", "1.14.0"),
    others_with_and_without=({"deepspeed": "0.19.8"}, {"deepspeed": "0.19.2"}),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0198",),
)
