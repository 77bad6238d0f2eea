"""Reproducers: a real Accelerator with the DeepSpeed plugin (ZeRO-2, CPU, one process) on a tiny Llama, a custom loop
that calls `accelerator.backward(out.loss); optimizer.step(); optimizer.zero_grad()` on each of 6 micro-batches
without `accelerator.accumulate`, at the config's gradient accumulation 3, SGD (an update is the gradient itself),
against plain torch taking the 2 steps DeepSpeed's own count means (windows [1, 2, 3] and [4, 5, 6], each loss / 3);
and, where the job decides, the loop under `accumulate` over a one-batch dataloader, which syncs at every batch (stock
is right there: it proves the fix stays out, and that its record of accelerate's decisions is needed).

Tolerance: relative 1e-5, as accelerate/deepspeed-ga-boundary's (flat fp32 buffers sum in another order); the bug moves
weights by tens of percent. Where the weights differ, the reproducer says "bug" only if they are exactly those of a step
on every micro-batch, each on its gradient / 3, and fails with an error otherwise.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

GA, BATCHES, LR, RTOL = 3, 6, 0.5, 1e-5


def config(stage=2, ga=GA):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ga, "steps_per_print": 10**6,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}


def plain_torch(steps):
    """The weights after plain-torch SGD steps: `steps` is a list of windows of micro-batch indices, each loss / GA."""
    from dspatch.scenario import lm_batches, sgd_windows, tiny_llama

    batches = lm_batches(BATCHES)
    return sgd_windows(tiny_llama(), [[(batches[i], GA) for i in window] for window in steps], LR)


def loop_without_accumulate():
    """6 micro-batches at accumulation 3 without `accelerator.accumulate`: DeepSpeed's own 2 steps, as plain torch."""
    from dspatch.scenario import accelerate_sgd_loop, lm_batches, worst

    got = accelerate_sgd_loop(config(), lm_batches(BATCHES), accumulate=False, lr=LR)
    off = worst(got, plain_torch([[0, 1, 2], [3, 4, 5]]))
    if off <= RTOL:
        return
    if worst(got, plain_torch([[i] for i in range(BATCHES)])) <= RTOL:
        raise BugSeen(f"a loop without accelerator.accumulate under DeepSpeed at accumulation {GA}: an optimizer step "
                      f"on every micro-batch, each on its gradient / {GA} (weights {off:.0%} off DeepSpeed's "
                      f"{BATCHES // GA} steps)")
    raise AssertionError(f"weights {off:.2e} off plain torch, and not as a step on every micro-batch")


def accumulate_syncing_every_batch():
    """A loop under `accelerator.accumulate` over a dataloader of one batch: accelerate syncs at its end (the end of
    the dataloader), so its one micro-batch is a window and a step; the job decided the boundary, and DeepSpeed's count
    (no step before the third micro-batch) must not be taken. Stock is right; the fix must stay out."""
    from dspatch.scenario import accelerate_sgd_loop, lm_batches, worst

    got = accelerate_sgd_loop(config(), lm_batches(1), lr=LR)
    off = worst(got, plain_torch([[0]]))
    if off > RTOL:
        raise BugSeen(f"accelerator.accumulate synced on a one-batch dataloader, yet no step as accelerate means it "
                      f"(weights {off:.0%} off): DeepSpeed's own count taken where the job decided")


PROOF = Proof(
    scenarios={"loop_without_accumulate": loop_without_accumulate,
               "accumulate_syncing_every_batch": accumulate_syncing_every_batch},
    expected_on_stock={"loop_without_accumulate": "an optimizer step on every micro-batch, each on its gradient / 3"},
    releases_checked=("1.8.0", "1.15.0"),
    others_with_and_without=({"deepspeed": "0.16.3"}, {"deepspeed": None}),  # the bug needs DeepSpeed, any
    silent="GA times the optimizer steps, each on 1/GA of the window's gradient, no message: proven by numbers",
)
