"""Reproducers: a real `deepspeed.initialize` (CPU) on a tiny Llama in bf16 at ZeRO-1 with
`data_types.grad_accum_dtype` fp32 (DeepSpeed's BF16_Optimizer), SGD; one step whose loss is multiplied by inf, so the
gradient is non-finite and DeepSpeed skips the step. DeepSpeed's logger is listened to: a skipped step must say so.
The same at ZeRO-2 (DeepSpeed's ZeRO optimizer, whose loss scaler logs the skip on 0.19.8): there exactly one line,
the fix adding none.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof


def skipped_step_lines(stage, grad_accum_dtype):
    """(steps DeepSpeed skipped, the lines DeepSpeed's logger wrote that say a step was skipped) for one step on a
    non-finite gradient."""
    import torch

    from dspatch.patches.skipped_step import lines_saying_skipped
    from dspatch.scenario import init_deepspeed, lm_batches, tiny_llama

    deepspeed = init_deepspeed()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": grad_accum_dtype}}
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    wrapper = type(engine.optimizer).__name__
    with lines_saying_skipped() as lines:
        batch = lm_batches(1)[0]
        engine.backward(engine(**batch).loss * float("inf"))
        engine.step()
    return engine.skipped_steps, lines, wrapper


def bf16_optimizer():
    skipped, lines, wrapper = skipped_step_lines(1, "fp32")
    if wrapper != "BF16_Optimizer" or skipped != 1:
        raise AssertionError(f"ZeRO-1 bf16 with fp32 accumulation: {wrapper}, {skipped} steps skipped (wanted "
                             f"BF16_Optimizer skipping 1)")
    if not lines:
        raise BugSeen("bf16 at ZeRO-1 with fp32 gradient accumulation (BF16_Optimizer): a step skipped for a "
                      "non-finite gradient, and DeepSpeed said nothing")
    if len(lines) != 1:
        raise AssertionError(f"the skipped step said {len(lines)} times: {lines}")


def zero2_says_it_once():
    skipped, lines, wrapper = skipped_step_lines(2, "bf16")
    if skipped != 1 or len(lines) != 1:
        raise BugSeen(f"bf16 at ZeRO-2 ({wrapper}): {skipped} steps skipped, said {len(lines)} times: {lines}")


PROOF = Proof(
    scenarios={"bf16_optimizer": bf16_optimizer, "zero2_says_it_once": zero2_says_it_once},
    expected_on_stock={"bf16_optimizer": "a step skipped for a non-finite gradient, and DeepSpeed said nothing"},
    releases_checked=("0.19.7", "0.19.8"),
    silent="a skipped step writes nothing (the bug is the missing line): proven by listening to DeepSpeed's logger",
)
