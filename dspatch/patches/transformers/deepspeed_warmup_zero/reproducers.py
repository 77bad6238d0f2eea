"""Reproducers: the real Trainer at ZeRO-2 with a DeepSpeed WarmupLR block whose values are "auto" (as the
documented configs have it), three steps of SGD, no warmup asked for.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import re

from dspatch.patches.transformers.deepspeed_warmup_zero import REFUSED
from dspatch.spec import BugSeen, Proof

CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 10**6,
          "zero_optimization": {"stage": 2},
          "scheduler": {"type": "WarmupLR",
                        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}


def _rates(**arguments):
    """The learning rate the Trainer logged at each of three steps."""
    import copy

    from dspatch.scenario import init_deepspeed, lm_rows, sgd_trainer, tiny_llama

    init_deepspeed()
    trainer, _ = sgd_trainer(tiny_llama(), lm_rows(6, 8), copy.deepcopy(CONFIG), batch=2, accumulation=1, steps=3,
                             lr=0.1, **arguments)
    return [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]


def auto_warmup_without_warmup_trains():
    """A run without warmup (warmup_steps 0) and an "auto" WarmupLR trains, at the rates of one warmup step (what
    deepspeed 0.19.2 and earlier made of 0)."""
    try:
        rates = _rates()
    except ValueError as e:
        if not re.search(REFUSED, str(e)):
            raise
        raise BugSeen(f"deepspeed.initialize refused the Trainer's \"auto\" warmup: ValueError: {e}") from e
    wanted = _rates(warmup_steps=1)
    if rates != wanted:
        raise AssertionError(f"learning rates {rates}, those of one warmup step {wanted}")


PROOF = Proof(
    scenarios={"auto_warmup_without_warmup_trains": auto_warmup_without_warmup_trains},
    expected_on_stock={"auto_warmup_without_warmup_trains": "refused the Trainer's \"auto\" warmup: ValueError: "
                                                            "warmup_num_steps must be a positive integer, got 0"},
    releases_checked=("4.44.0", "5.17.0"),
    others_with_and_without=({"deepspeed": "0.19.8"}, {"deepspeed": "0.19.2"}),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0198",),
)
