"""A step skipped for a non-finite gradient under a static loss scale says so (deepspeed <= 0.19.7; fixed in 0.19.8).

Stock skips it without a word: the weights do not move, the gradients are cleared, and nothing in the log says why the
loss stopped improving.

A silent one. The ZeRO optimizers check the gradient for inf and NaN, skip the step where they find one, and tell their
loss scaler (`update_scale(overflow)`); only the dynamic scaler logs it (`OVERFLOW! Rank 0 Skipping step. Attempted
loss scale: ...`). A static one, which bf16 always has and fp16 has with a fixed `loss_scale`, inherits
`LossScalerBase.update_scale`, which does nothing. bf16 checks since 0.17.1 when `bf16.check_grad_overflow` is set,
and by default since 0.19.3 (PR 8035), so from 0.19.3 a bf16 run at ZeRO-1/2/3 that meets one non-finite gradient
loses a step silently (DeepSpeed issue 8415); fp16 with a static scale always did. 0.19.8 (PRs 8417, 8426) logs
`[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.` at WARNING on rank 0 from
`LossScalerBase.update_scale`. (fp32 ZeRO checks nothing: no step is skipped there.)

The fix writes that line, as 0.19.8 does, where a static scaler is told of an overflow; the numbers are untouched, and
the dynamic scaler, which overrides the method and logs its own line, is not changed.

Proven on the old, bridge and mid stacks and on 0.18.3 (its session, ds0183): one fp16 ZeRO-2 step with a
static loss scale on an infinite loss is skipped, silently on stock, and now says so once; from 0.17.1, bf16 with
`check_grad_overflow: true` the same. The diff makes the same change in `LossScalerBase.update_scale` (two bands, 0.14.0-0.18.2
and 0.18.3-0.19.7, for the method after it; with the module's own logger, on rank 0).
"""
from dspatch.spec import Patch

SCALER = "deepspeed.runtime.fp16.loss_scaler"
UPDATE = "LossScalerBase.update_scale"
FINGERPRINTS = {(SCALER, UPDATE): {"b2d4e1b39c2869f2": "0.14.0-0.19.7"}}
def say_skipped(wrapped, scaler, args, kwargs):
    result = wrapped(*args, **kwargs)
    if bool(args[0] if args else kwargs["overflow"]):  # told of an overflow: the step is being skipped
        from dspatch.patches.skipped_step import say_skipped

        say_skipped()
    return result


def apply(txn):
    txn.wrap(txn.target(UPDATE), say_skipped)


PATCH = Patch(
    id="deepspeed/static-scaler-silent-skip",
    summary=("a step skipped for a non-finite gradient under a static loss scale (bf16's; fp16's fixed loss_scale) "
             "logs the OVERFLOW line of deepspeed 0.19.8 (numbers unchanged)"),
    cause=("the ZeRO optimizers skip a step on a non-finite gradient and tell their loss scaler, and a static scaler's "
           "update_scale does nothing: only the dynamic scaler logs the skip"),
    symptom="a step skipped without a word: bf16 (0.19.3 on, or check_grad_overflow) or a static fp16 loss_scale",
    distribution="deepspeed",
    affected="<0.19.8",
    fixed_in="0.19.8",
    supported=">=0.14.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/8415", "https://github.com/deepspeedai/DeepSpeed/pull/8426",
           "https://github.com/deepspeedai/DeepSpeed/pull/8417"),
    diffs=("deepspeed/0033-static-scaler-silent-skip-0.14.0-0.18.2.patch",
           "deepspeed/0033-static-scaler-silent-skip-0.18.3-0.19.7.patch"),
    note="LossScalerBase.update_scale is wrapped: told of an overflow, it logs DeepSpeed 0.19.8's OVERFLOW line on rank 0",
)
