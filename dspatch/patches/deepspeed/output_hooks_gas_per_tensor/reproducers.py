"""Reproducers: real deepspeed.initialize at ZeRO-1 (CPU, one process) on a tiny Llama called with labels, so that its
output holds the loss and the logits the loss was computed from; gradient accumulation 3, two SGD steps (an update is
the gradient itself): the raw engine loop (`engine.backward(out.loss)`) and a custom accelerate loop
(`accelerator.accumulate`, `accelerator.backward(out.loss)`), each against the same steps taken by plain torch (each
micro-batch's loss / GA, backward, step). A silent bug, proven by numbers.

Tolerance: DeepSpeed sums a window's gradients in flat fp32 buffers, torch per parameter, in another order: relative
1e-5 is far above that and far below the bug's factor of 3. Where the weights differ, a reproducer says "bug" only if
they are exactly those of plain torch at a learning rate divided by GA again (every gradient GA times too small), and
fails with an error otherwise.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, GA, LR, RTOL = 2, 3, 0.5, 1e-5


def _config(stage=1, **extra):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GA, "steps_per_print": 10**6,
            "gradient_clipping": 0.0,  # deepspeed >= 0.19 clips at 1.0 unless told: here an update is the gradient
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}, **extra}


def batches(count=STEPS * GA):
    from dspatch.scenario import lm_batches

    return lm_batches(count)


def model_loss(out, batch):
    return out.loss


def plain_torch(lr=LR, accumulation=GA, loss_of=model_loss):
    """The weights after STEPS SGD steps without DeepSpeed, each micro-batch's loss (`loss_of(output, batch)`)
    divided by `accumulation`."""
    from dspatch.scenario import sgd_windows, tiny_llama, windows

    return sgd_windows(tiny_llama(), windows(batches(STEPS * accumulation), accumulation), lr,
                       lambda model, batch: loss_of(model(**batch), batch))


def engine_weights(stage=1, loss_of=model_loss, labels=True, **backward):
    """The weights after STEPS SGD steps of `out = engine(**batch); engine.backward(loss_of(out, batch), **backward);
    engine.step()`; `labels=False`: the model is called with the input ids alone (its output: the logits)."""
    import torch

    from dspatch.scenario import init_deepspeed, tiny_llama, weights

    deepspeed = init_deepspeed()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=_config(stage))
    for batch in batches():
        out = engine(**batch) if labels else engine(input_ids=batch["input_ids"])
        engine.backward(loss_of(out, batch), **backward)
        engine.step()
    if stage == 3:  # the whole weights, gathered from their partitions
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return weights(model)
    return weights(model)


def judge(got, what):
    from dspatch.scenario import worst

    off = worst(got, plain_torch())
    if off <= RTOL:
        return
    if worst(got, plain_torch(lr=LR / GA)) <= RTOL:
        raise BugSeen(f"{what}, accumulation {GA}: the gradient divided by {GA} once per output tensor on the loss's "
                      f"graph (loss and logits: {GA * GA} in all; weights {off:.0%} off plain torch)")
    raise AssertionError(f"{what}: weights {off:.2e} off plain torch, and not as this bug scales them")


def engine_loop():
    """`out = engine(**batch, labels=...)`; `engine.backward(out.loss)`; `engine.step()` at accumulation 3: plain
    torch's weights."""
    judge(engine_weights(), "engine.backward(out.loss)")


def accelerate_loop():
    """A custom accelerate loop (`with accelerator.accumulate(model)`, `accelerator.backward(out.loss)`,
    `optimizer.step()`, `optimizer.zero_grad()`) with the DeepSpeed plugin at accumulation 3: plain torch's weights."""
    import torch

    from dspatch.scenario import init_deepspeed, reset_accelerate, tiny_llama, weights

    init_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    reset_accelerate()
    try:
        accelerator = Accelerator(gradient_accumulation_steps=GA, deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config=_config(), gradient_accumulation_steps=GA))
        model = tiny_llama()
        engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        if type(engine).__name__ != "DeepSpeedEngine" or engine.gradient_accumulation_steps() != GA:
            raise AssertionError(f"accelerate prepared {type(engine).__name__}, not DeepSpeed at accumulation {GA}")
        for batch in batches():
            with accelerator.accumulate(engine):
                accelerator.backward(engine(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        reset_accelerate()
    judge(weights(model), "accelerator.backward(out.loss) in a custom loop")


PROOF = Proof(
    scenarios={"engine_loop": engine_loop, "accelerate_loop": accelerate_loop},
    expected_on_stock={"engine_loop": "engine.backward(out.loss), accumulation 3: the gradient divided by 3 once per",
                       "accelerate_loop": "accelerator.backward(out.loss) in a custom loop, accumulation 3"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.18.2", "0.19.8"),
    silent="every gradient GA times too small, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183",),
)
