"""Reproducers: real deepspeed.initialize (CPU, one process) on a tiny Llama called with labels, so that its output
holds the loss and the logits the loss was computed from; gradient accumulation 3, two SGD steps (an update is the
gradient itself) of the PyTorch-style loop DeepSpeed documents since 0.18.3: `out = engine(**batch);
out.loss.backward(); engine.step()`, at ZeRO-1 and ZeRO-2, each against the same steps taken by plain torch (each
micro-batch's loss / GA, backward, step). A silent bug, proven by numbers.

Tolerance: DeepSpeed sums a window's gradients in flat fp32 buffers, torch per parameter, in another order: relative
1e-5 is far above that and far below the bug's factor of 3. Where the weights differ, a reproducer says "bug" only if
they are exactly those of plain torch at a learning rate divided by GA again, and fails with an error otherwise.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, GA, LR, RTOL = 2, 3, 0.5, 1e-5


def config(stage=1, accumulation=GA):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 10**6,
            "gradient_clipping": 0.0,  # deepspeed >= 0.19.3 clips at 1.0 unless told: here an update is the gradient
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}


def model_loss(out, batch):
    return out.loss


def plain_torch(lr=LR, accumulation=GA, loss_of=model_loss):
    """The weights after STEPS SGD steps without DeepSpeed, each micro-batch's `loss_of(output, batch)` / GA."""
    from dspatch.scenario import lm_batches, sgd_windows, tiny_llama, windows

    return sgd_windows(tiny_llama(), windows(lm_batches(STEPS * accumulation), accumulation), lr,
                       lambda model, batch: loss_of(model(**batch), batch))


def direct_weights(stage=1, loss_of=model_loss, accumulation=GA, backward=None, labels=True):
    """The weights after STEPS SGD steps of `out = engine(**batch); loss_of(out, batch).backward(); engine.step()`
    (`backward(engine, loss)` in its place where given; `labels=False`: the model called with the input ids alone,
    its output the logits)."""
    import torch

    from dspatch.scenario import gathered_whole, init_deepspeed, lm_batches, tiny_llama, weights

    deepspeed = init_deepspeed()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config(stage, accumulation))
    for batch in lm_batches(STEPS * accumulation):
        loss = loss_of(engine(**batch) if labels else engine(input_ids=batch["input_ids"]), batch)
        if backward is None:
            loss.backward()
        else:
            backward(engine, loss)
        engine.step()
    return gathered_whole(model.named_parameters()) if stage == 3 else weights(model)


def judge(got, what):
    from dspatch.scenario import worst

    off = worst(got, plain_torch())
    if off <= RTOL:
        return
    if worst(got, plain_torch(lr=LR / GA)) <= RTOL:
        raise BugSeen(f"{what}, accumulation {GA}: the gradient divided by {GA} at the loss and again at the logits "
                      f"({GA * GA} in all; weights {off:.0%} off plain torch)")
    raise AssertionError(f"{what}: weights {off:.2e} off plain torch, and not as this bug scales them")


def zero1_loss_backward():
    """`out.loss.backward()` at ZeRO-1, accumulation 3: plain torch's weights."""
    judge(direct_weights(1), "ZeRO-1 out.loss.backward()")


def zero2_loss_backward():
    """`out.loss.backward()` at ZeRO-2, accumulation 3: plain torch's weights."""
    judge(direct_weights(2), "ZeRO-2 out.loss.backward()")


PROOF = Proof(
    scenarios={"zero1_loss_backward": zero1_loss_backward, "zero2_loss_backward": zero2_loss_backward},
    expected_on_stock={"zero1_loss_backward": "ZeRO-1 out.loss.backward(), accumulation 3: the gradient divided by 3",
                       "zero2_loss_backward": "ZeRO-2 out.loss.backward(), accumulation 3: the gradient divided by 3"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.18.2", "0.19.8"),
    silent="every gradient GA times too small, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183", "ds0192", "ds0198"),
)
