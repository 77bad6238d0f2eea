"""A step DeepSpeed's BF16_Optimizer skips for a non-finite gradient says so, as its other optimizers do (deepspeed
0.19.8, open upstream).

Stock skips the step without a word: the weights do not move, the gradients are cleared, and nothing in the log says
why the loss stopped improving.

A silent one. 0.19.8 made `BF16_Optimizer.step` skip a step whose gradient norm is not finite (it asserted a positive
norm before), setting `overflow` for the engine's count of skipped steps, and made the static loss scaler of the ZeRO
optimizers log `[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.` at WARNING on
rank 0 (DeepSpeed issue 8415, PRs 8417 and 8426: the fix of 0.19.3-0.19.7's silent skips). BF16_Optimizer keeps no loss
scaler, and its skip was left out: it is the optimizer of bf16 at ZeRO-1 with `data_types.grad_accum_dtype` fp32
(and of bf16 pipelines at ZeRO-0), which still skip silently.

The fix writes the same line, at the same level on rank 0, after a `BF16_Optimizer.step` that skipped; the numbers are
untouched (a step that did not skip writes nothing, and the ZeRO optimizers, which already log it, are not wrapped).

Proven on the latest stack (deepspeed 0.19.8): one bf16 ZeRO-1 step with fp32 accumulation on an infinite loss is
skipped and now says so, once; at ZeRO-2 DeepSpeed's own line stays the only one.
"""
from dspatch.spec import Patch

BF16 = "deepspeed.runtime.bf16_optimizer"
STEP = "BF16_Optimizer.step"
FINGERPRINTS = {(BF16, STEP): {"cb5f5a6a26f1f680": "0.19.8-0.19.8"}}
def say_skipped(wrapped, optimizer, args, kwargs):
    result = wrapped(*args, **kwargs)
    if getattr(optimizer, "overflow", False) is True:
        from dspatch.patches.skipped_step import say_skipped

        say_skipped()  # 0.19.8's own line, as its loss scaler writes it for the other optimizers
    return result


def apply(txn):
    txn.wrap(txn.target(STEP), say_skipped)


PATCH = Patch(
    id="deepspeed/bf16-optimizer-silent-skip",
    summary=("bf16 at ZeRO-1 with fp32 gradient accumulation (BF16_Optimizer): a step skipped for a non-finite "
             "gradient logs DeepSpeed's own OVERFLOW line, as the other optimizers do (numbers unchanged)"),
    cause=("deepspeed 0.19.8's BF16_Optimizer skips a step on a non-finite gradient norm but, keeping no loss scaler, "
           "never logs the skip the other optimizers log"),
    symptom="a step skipped without a word: the weights stop moving and nothing says why",
    distribution="deepspeed",
    affected=">=0.19.8",
    fixed_in=None,
    supported=">=0.19.8",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/8415", "https://github.com/deepspeedai/DeepSpeed/pull/8426",
           "https://github.com/deepspeedai/DeepSpeed/pull/8417"),
    diffs=("deepspeed/0030-bf16-optimizer-silent-skip-0.19.8.patch",),
    note="BF16_Optimizer.step is wrapped: after a skipped step, DeepSpeed's OVERFLOW line is logged on rank 0",
)
