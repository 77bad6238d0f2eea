"""Reproducers: real deepspeed.initialize (CPU, one process), gradient accumulation 3, two SGD steps (an update is the
gradient itself), each against plain torch: the raw engine loop on a tiny Llama at ZeRO-1 with `engine.no_sync()`
around the micro-steps that are not a window's last (what accelerate's `accumulate` does at ZeRO-0/1 in a
multi-process job), and a one-stage `PipelineModule` (a small MLP) trained with `train_batch`. A silent bug, proven by
numbers.

Tolerance: relative 1e-5, as deepspeed/zero2-offload-grad-accum's reproducers (flat fp32 buffers sum in another
order); the bug moves weights by tens of percent or more. Where the weights differ, a reproducer says "bug" only if
they are plain torch's with exactly those micro-steps left undivided, and fails with an error otherwise.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.scenario import lm_batches, lm_loss, regression_pairs, sgd_windows, tiny_mlp, weights, windows, worst
from dspatch.spec import BugSeen, Proof
from dspatch.patches.deepspeed.output_hooks_gas_per_tensor.reproducers import GA, LR, RTOL, STEPS


def accumulation_config(stage=1, **extra):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GA, "steps_per_print": 10**6,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
            **extra}


def _judge(got, make, micro_batches, loss_of, undivided, what):
    """Plain torch's weights (`make()`, SGD over `micro_batches`), or BugSeen(what...) where they are plain torch's
    with the micro-steps at the window positions `undivided` left undivided."""
    off = worst(got, sgd_windows(make(), windows(micro_batches, GA), LR, loss_of))
    if off <= RTOL:
        return
    left = windows(micro_batches, GA, lambda position: 1 if position in undivided else GA)
    if worst(got, sgd_windows(make(), left, LR, loss_of)) <= RTOL:
        raise BugSeen(f"{what}, accumulation {GA}: those micro-steps' loss not divided by {GA} (weights {off:.0%} off "
                      f"plain torch)")
    raise AssertionError(f"{what}: weights {off:.2e} off plain torch, and not as this bug scales them")


def engine_loop(stage=1, no_sync=True):
    """The weights after STEPS SGD steps of the raw loop at ZeRO `stage`, with `engine.no_sync()` around every
    micro-step but a window's last (`no_sync=False`: without it)."""
    import contextlib

    import torch

    from dspatch.scenario import init_deepspeed, tiny_llama

    deepspeed = init_deepspeed()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=accumulation_config(stage))
    for batch in lm_batches(STEPS * GA):
        inside = no_sync and not engine.is_gradient_accumulation_boundary()
        with engine.no_sync() if inside else contextlib.nullcontext():
            engine.backward(engine(**batch).loss)
        engine.step()
    return weights(model)


def no_sync_loop():
    """`with engine.no_sync(): engine.backward(loss)` on the first two micro-steps of each window, `engine.backward`
    on the last, `engine.step()` after each, at ZeRO-1: plain torch's weights."""
    from dspatch.scenario import tiny_llama

    _judge(engine_loop(), tiny_llama, lm_batches(STEPS * GA), lm_loss, range(GA - 1),
           "engine.no_sync() around the micro-steps before a window's last")


def _pairs():
    return regression_pairs(STEPS * GA)


def pipeline_weights(accumulation=GA):
    """The weights after STEPS `engine.train_batch()` of a one-stage PipelineModule (Linear-Tanh-Linear, MSE loss)."""
    import torch

    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(layers=tiny_mlp(), num_stages=1, loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=LR),
                                      config=accumulation_config(stage=0, gradient_accumulation_steps=accumulation))
    if type(engine).__name__ != "PipelineEngine":
        raise AssertionError(f"deepspeed.initialize made a {type(engine).__name__}, not a PipelineEngine")
    data = iter(_pairs())
    for _ in range(STEPS):
        engine.train_batch(data_iter=data)
    return weights(module)  # PipelineModule names its layers' parameters as torch.nn.Sequential does: "0.weight"...


def pipeline():
    """A one-stage PipelineModule (Linear-Tanh-Linear, MSE loss), `engine.train_batch()` twice at accumulation 3:
    plain torch's weights."""
    import torch

    got = pipeline_weights()

    def reference():
        return torch.nn.Sequential(*tiny_mlp())

    def mse(model, pair):
        return torch.nn.functional.mse_loss(model(pair[0]), pair[1])

    _judge(got, reference, _pairs(), mse, range(GA), "a PipelineEngine's steps")


PROOF = Proof(
    scenarios={"no_sync_loop": no_sync_loop, "pipeline": pipeline},
    expected_on_stock={"no_sync_loop": "engine.no_sync() around the micro-steps before a window's last, accumulation 3",
                       "pipeline": "a PipelineEngine's steps, accumulation 3: those micro-steps' loss not divided"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.15.4", "0.18.3"),
    silent="gradients GA times too big, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0182",),
)
