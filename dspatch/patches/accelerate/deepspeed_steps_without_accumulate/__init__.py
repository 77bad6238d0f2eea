"""A custom accelerate loop without `accelerator.accumulate()` under DeepSpeed lets DeepSpeed count its accumulation
again (accelerate >= 1.8.0, open upstream).

Stock takes an optimizer step on every micro-batch, each on 1/GA of its window's gradient, and DeepSpeed's scheduler
runs GA times too fast.

A silent one: no error, no warning. Since 1.8.0 (PR 3630) accelerate's `DeepSpeedEngineWrapper.backward` tells the
engine `set_gradient_accumulation_boundary(sync_gradients)` before every backward and calls `engine.step()` only when
`sync_gradients` is true. `GradientState.sync_gradients` starts true and only `accelerator.accumulate()` (or a caller
that sets it, as the Trainer does) ever clears it, while `_prepare_deepspeed` copies the config's
`gradient_accumulation_steps` into accelerate (PR 3632) and `engine.backward` still divides each loss by it. A loop
that leaves the accumulation to DeepSpeed, as accelerate's own `examples/by_feature/deepspeed_with_config_support.py`
says it may ("DeepSpeed handles gradient_accumulation via DeepSpeedEngine"), and as every release before 1.8.0 did,
gets GA times the steps. Measured on accelerate 1.8.1, 1.10.1 and 1.15.0: 6 micro-batches at accumulation 3 take 6
optimizer steps, not 2.

The fix: where nothing in the job has decided a micro-step's boundary yet (no `accumulate()`, no caller setting
`sync_gradients`, and `sync_gradients` never false at a backward), the wrapper runs `engine.backward(loss)` and
`engine.step()` without overriding DeepSpeed's boundary, so DeepSpeed counts, as before 1.8.0. It stays out:
- once accelerate decides (a job that uses `accumulate()`, the Trainer and trl's trainers): stock, to the bit;
- at accumulation 1 (a step on every micro-batch is what both counts mean);
- with `"managed_gradient_accumulation": false` (deepspeed >= 0.19.4), where the caller owns the boundary by design.

Proven by numbers on the bridge, mid and latest stacks: the 6 micro-batches take DeepSpeed's 2 steps, as plain torch
does (relative 1e-5); stock takes 6.
"""
from dspatch.spec import Patch

STATE = "accelerate.state"
SET_SYNC = "GradientState._set_sync_gradients"
DEEPSPEED = "accelerate.utils.deepspeed"
BACKWARD = "DeepSpeedEngineWrapper.backward"
FINGERPRINTS = {
    (STATE, SET_SYNC): {"1549ff0bf1db58df": "1.8.0-1.15.0"},
    (DEEPSPEED, BACKWARD): {"920954e8dbea5457": "1.8.0-1.15.0"},
}

# Kept in GradientState's shared state (so a reset of accelerate's state forgets it): true once the job decided a
# micro-step's boundary itself
DECIDED = "_dspatch_boundary_decided"


def apply(txn):
    shared = []  # GradientState's shared storage, once seen

    def record(wrapped, state, args, kwargs):
        state.__dict__[DECIDED] = True
        shared[:] = [state.__dict__]
        return wrapped(*args, **kwargs)

    def deepspeed_counts(wrapped, wrapper, args, kwargs):
        def split(loss, sync_gradients=True, **rest):
            return loss, sync_gradients, rest

        loss, sync_gradients, rest = split(*args, **kwargs)
        engine = wrapper.engine
        decided = bool(shared and shared[0].get(DECIDED))
        if not sync_gradients and shared:
            shared[0][DECIDED] = True  # someone set sync_gradients false: the job decides its boundaries
        managed = getattr(engine, "managed_gradient_accumulation", None)
        if (decided or not sync_gradients or engine.gradient_accumulation_steps() == 1
                or (callable(managed) and not managed())):
            return wrapped(*args, **kwargs)
        engine.backward(loss, **rest)
        engine.step()  # at DeepSpeed's own boundary an update; elsewhere a micro-step's bookkeeping

    txn.wrap(txn.target(SET_SYNC), record)
    txn.wrap(txn.target(BACKWARD), deepspeed_counts)


PATCH = Patch(
    id="accelerate/deepspeed-steps-without-accumulate",
    summary=("accelerate >= 1.8 + DeepSpeed, a loop without accelerator.accumulate: DeepSpeed counts the accumulation "
             "again, one optimizer step per window instead of one per micro-batch (silent)"),
    cause=("accelerate >= 1.8 marks every micro-step outside accumulate() a boundary and steps the engine each time, "
           "while DeepSpeed still divides each loss by the config's accumulation"),
    canary=("windows",),
    symptom="GA times the optimizer steps, each on 1/GA of the window's gradient; the schedule runs GA times too fast",
    distribution="accelerate",
    affected=">=1.8.0",
    fixed_in=None,
    supported=">=1.8.0",
    requires={"deepspeed": ">=0"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/accelerate/pull/3630", "https://github.com/huggingface/accelerate/pull/3632",
           "https://github.com/huggingface/accelerate/blob/main/examples/by_feature/deepspeed_with_config_support.py"),
    diffs=("accelerate/0008-deepspeed-steps-without-accumulate-1.8.0-1.15.0.patch",),
    note=("DeepSpeedEngineWrapper.backward is wrapped: until the job decides a boundary (accumulate(), the Trainer, "
          "sync_gradients set false), DeepSpeed's own count decides where an optimizer step is taken"),
)
