"""Reproducers: a real Accelerator with the DeepSpeed plugin (CPU, one process) on a tiny Llama, a custom loop over
`accelerator.accumulate(model)` on 6 micro-batches at gradient accumulation 3 with the config's
`"managed_gradient_accumulation": false`, SGD (an update is the gradient itself), at ZeRO-1 and ZeRO-2, against plain
torch taking accelerate's 2 steps (windows [1, 2, 3] and [4, 5, 6], each loss / 3).

Stock fails at the first backward with DeepSpeed's own assertion; the reproducer says "bug" on that message only.
Tolerance: relative 1e-5, as accelerate/deepspeed-ga-boundary's.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

GA, BATCHES, LR, RTOL = 3, 6, 0.5, 1e-5
REFUSED = "set_gradient_accumulation_boundary() is not supported with managed_gradient_accumulation=False"


def config(stage):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GA, "steps_per_print": 10**6,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
            "managed_gradient_accumulation": False}


def accumulate_loop(stage):
    """accelerate's 2 steps over 6 micro-batches at accumulation 3, the caller owning DeepSpeed's boundary."""
    from dspatch.scenario import accelerate_sgd_loop, lm_batches, sgd_windows, tiny_llama, windows, worst

    batches = lm_batches(BATCHES)
    try:
        got = accelerate_sgd_loop(config(stage), batches, lr=LR)
    except AssertionError as error:
        if REFUSED not in str(error):
            raise
        raise BugSeen(f"accelerator.backward at ZeRO-{stage} with managed_gradient_accumulation false: "
                      f"AssertionError: {error}") from error
    off = worst(got, sgd_windows(tiny_llama(), windows(batches, GA), LR))
    if off > RTOL:
        raise AssertionError(f"weights {off:.2e} off plain torch's {BATCHES // GA} steps")


def zero1():
    accumulate_loop(1)


def zero2():
    accumulate_loop(2)


PROOF = Proof(
    scenarios={"zero2": zero2, "zero1": zero1},
    expected_on_stock={"zero2": REFUSED, "zero1": REFUSED},
    releases_checked=("1.8.0", "1.15.0"),
    others_with_and_without=({"deepspeed": "0.19.8"}, {"deepspeed": "0.19.3"}),
)
