"""A pipeline of two or more stages divides each stage's gradient by the gradient accumulation once, not once per
stage from there to the last (deepspeed 0.18.3-0.19.2).

Stock shrinks every stage but the last by GA for each later stage.

A silent one: no error, no warning. From 0.18.3 (PR 7665) `DeepSpeedEngine.forward` hooks its outputs so that their
gradients are divided by `gradient_accumulation_steps` on the way back. In a `PipelineEngine` every stage runs that
forward: the last stage's hook divides the gradient once, as it should, and sends it upstream; every earlier stage
back-propagates what it received through its own hooked outputs and divides again. With 2 stages the first stage
trains GA times too slowly, with 4 the first GA^3 times (DeepSpeed issues 7773, 8152; fixed in 0.19.3, PR 8154).
0.16.0-0.18.2 had another cause with the opposite sign, no division at all: `deepspeed/grad-accum-scale-no-allreduce`.

The fix is 0.19.3's: on a pipeline stage that is not the last, the output hooks pass the gradient through (it was
divided on the last stage). One-stage pipelines, the last stage and every other engine run stock's code.

Proven by numbers on deepspeed 0.18.3 (the ds0183 session) and 0.19.2's released source, 2 ranks (gloo, forked as
torchrun would start them), by `dspatch canary`'s comparison: a 2-stage `PipelineModule` of its token model at ZeRO-1,
accumulation 3, SGD, `train_batch` over two epochs: every step's gradient and update are plain torch's on both
stages; stock's last stage has plain torch's gradient and its first stage plain torch's divided by 3 again. (ZeRO-0
pipelines of 2+ stages stop at once on 0.18.3 with "Direct calls to tensor.backward() are not supported", a failure
of its own, not this bug.)
"""
from dspatch.spec import Patch

ENGINE = "deepspeed.runtime.engine"
PER_TENSOR = "DeepSpeedEngine._backward_prologue_per_tensor"
FINGERPRINTS = {(ENGINE, PER_TENSOR): {"fe0ec5bb47548e42": "0.18.3", "f245b7b18e43cdd6": "0.18.4-0.19.0",
                                       "12dfa251dba0bfee": "0.19.1-0.19.2"}}


def apply(txn):
    import sys

    def divided_on_the_last_stage(wrapped, engine, args, kwargs):
        pipe = sys.modules.get("deepspeed.runtime.pipe.engine")  # imported by deepspeed.initialize of a pipeline
        if pipe is not None and isinstance(engine, pipe.PipelineEngine) and not engine.is_last_stage():
            return args[0] if args else kwargs["grad"]  # the last stage divided it before sending it upstream
        return wrapped(*args, **kwargs)

    txn.wrap(txn.target(PER_TENSOR), divided_on_the_last_stage)


PATCH = Patch(
    id="deepspeed/pipe-grad-accum-scale",
    summary=("a pipeline of two or more stages divides each stage's gradient by the gradient accumulation steps once, "
             "not once per later stage (silent)"),
    cause="Each pipeline stage divides the gradient by GA again for every later stage",
    canary=('stage_divided',),  # dspatch canary --loop pipeline
    symptom="earlier pipeline stages' gradients silently GA times too small per later stage",
    distribution="deepspeed",
    affected=">=0.18.3,<0.19.3",
    fixed_in="0.19.3",
    supported=">=0.18.3",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8154", "https://github.com/deepspeedai/DeepSpeed/issues/7773",
           "https://github.com/deepspeedai/DeepSpeed/issues/8152", "https://github.com/deepspeedai/DeepSpeed/pull/7665"),
    diffs=("deepspeed/0019-pipe-grad-accum-scale-0.18.3-0.19.2.patch",),
    fixed_marker=("deepspeed.runtime.pipe.engine", "PipelineEngine._backward_prologue_per_tensor"),
    note=("wraps DeepSpeedEngine._backward_prologue_per_tensor: a pipeline stage that is not the last passes the "
          "gradient through"),
)
