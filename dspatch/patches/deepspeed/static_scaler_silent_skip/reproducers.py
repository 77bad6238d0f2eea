"""Reproducers: a real `deepspeed.initialize` (CPU) on a tiny Llama at ZeRO-2, SGD, one step whose loss is multiplied
by inf, so that the gradient is non-finite and DeepSpeed skips the step: in fp16 with a static loss scale (128), and
in bf16 with `check_grad_overflow: true` where the release has the key (0.17.1 on; the default from 0.19.3).
DeepSpeed's logger is listened to: a skipped step must say so, once.

fp16 on the CPU: the accelerator is told it supports fp16 (releases before 0.18 answer no), as `dspatch canary` does;
the engine's own code (its loss scaler, its overflow check) is unchanged.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof


def skipped_step_lines(precision):
    """(steps DeepSpeed skipped, the lines DeepSpeed's logger wrote that say a step was skipped) for one ZeRO-2 step on
    a non-finite gradient in `precision` ("fp16": a static loss scale of 128; "bf16": its check on)."""
    import torch

    from dspatch.canary.runner import allow_fp16_on_the_cpu
    from dspatch.patches.skipped_step import lines_saying_skipped
    from dspatch.scenario import init_deepspeed, lm_batches, tiny_llama

    deepspeed = init_deepspeed()
    allow_fp16_on_the_cpu()
    precision_config = ({"fp16": {"enabled": True, "loss_scale": 128}} if precision == "fp16"
                        else {"bf16": {"enabled": True, "check_grad_overflow": True}})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2},
              **precision_config}
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    with lines_saying_skipped() as lines:
        batch = lm_batches(1)[0]
        engine.backward(engine(**batch).loss * float("inf"))
        engine.step()
    return engine.skipped_steps, lines


def judge(precision, what):
    skipped, lines = skipped_step_lines(precision)
    if skipped != 1:
        raise AssertionError(f"{what}: {skipped} steps skipped on an infinite loss (wanted 1)")
    if not lines:
        raise BugSeen(f"{what}: a step skipped for a non-finite gradient, and DeepSpeed said nothing")
    if len(lines) != 1:
        raise AssertionError(f"{what}: the skipped step said {len(lines)} times: {lines}")


def fp16_static_scale():
    """fp16 at ZeRO-2 with a static loss scale of 128: the skipped step says so, once."""
    judge("fp16", "fp16 at ZeRO-2 with a static loss scale")


def bf16_checked():
    """bf16 at ZeRO-2 with check_grad_overflow (0.17.1 on): the skipped step says so, once; before 0.17.1 bf16 checks
    nothing and skips no step (nothing to say)."""
    import deepspeed

    from dspatch.versions import Version

    if Version(deepspeed.__version__) < Version("0.17.1"):
        skipped, lines = skipped_step_lines("bf16")
        if skipped or lines:
            raise AssertionError(f"bf16 before 0.17.1: {skipped} steps skipped, {lines}")
        return
    judge("bf16", "bf16 at ZeRO-2 with check_grad_overflow")


PROOF = Proof(
    scenarios={"fp16_static_scale": fp16_static_scale, "bf16_checked": bf16_checked},
    expected_on_stock={"fp16_static_scale": "fp16 at ZeRO-2 with a static loss scale: a step skipped for a "
                                            "non-finite gradient, and DeepSpeed said nothing",
                       "bf16_checked": "bf16 at ZeRO-2 with check_grad_overflow: a step skipped"},
    # bf16 checks nothing before 0.17.1: there stock skips no step, and has nothing to say
    stock_fails_on={"bf16_checked": ">=0.17.1"},
    releases_checked=("0.14.0", "0.19.8"),
    silent="a skipped step writes nothing (the bug is the missing line): proven by listening to DeepSpeed's logger",
    proven_in=("ds0183",),
)
