"""Under `accelerator.accumulate`, DeepSpeed steps where accelerate's accumulation ends, not at its own count
(accelerate < 1.8.0 with DeepSpeed).

Stock lets windows straddle epochs when the dataloader's length is not a multiple of the accumulation, and the last
partial window is never applied.

A silent one: no error, no warning. accelerate's `DeepSpeedEngineWrapper.backward` called `engine.backward(loss)` and
`engine.step()` on every micro-step, and DeepSpeed decided the accumulation boundary by counting micro-steps itself.
accelerate's own boundary (`sync_gradients`, set by `accelerator.accumulate`) also ends a window at the end of the
dataloader and starts counting again, so with 4 batches per epoch at accumulation 3 accelerate means windows [1 2 3] [4]
per epoch, while DeepSpeed steps on [1 2 3] [4 1' 2'] and never on [3' 4']; logging, schedulers and checkpoints that
follow accelerate's steps describe steps DeepSpeed did not take. 1.8.0 fixed it (PR 3630): the wrapper sets
`engine.set_gradient_accumulation_boundary(sync_gradients)` before the backward and steps only at the boundary.

The fix does so where accelerate decided the boundary of the micro-step: when `sync_gradients` was set since the
engine's last backward (`accelerator.accumulate` sets it on every micro-step; transformers' Trainer >= 4.46 sets it
itself), each DeepSpeed engine is told that boundary before its backward, and `engine.step()` runs as before (a
micro-step's bookkeeping where it is not the boundary). It stays out where accelerate's accumulation is not DeepSpeed's:
- a job that never sets `sync_gradients` (no `accumulate`) keeps DeepSpeed's own count, as it did; accelerate 1.8.0
  would step on every micro-step there, which such a loop did not ask for (once a job has set it, an engine keeps
  the boundary it was last told until told again, as with 1.8.0);
- where accelerate's accumulation steps differ from the engine's (a GA set in the DeepSpeed config file alone, which
  accelerate < 1.8 does not copy into its own count of 1; 1.8.0 copies it, PR 3632), DeepSpeed keeps its count.
Where the two counts agree (a dataloader whose length the accumulation divides; the Trainer of transformers < 4.46,
which counts across epochs as DeepSpeed does) nothing changes, to the bit.

Proven by numbers on the old stack (accelerate 0.34.2, deepspeed 0.14.4): 2 epochs of 4 batches at accumulation 3 in
a custom `accumulate` loop at ZeRO-2 take accelerate's four steps, as plain torch does (relative 1e-5); stock takes
DeepSpeed's two.
"""
from dspatch.spec import Patch

STATE = "accelerate.state"
SET_SYNC = "GradientState._set_sync_gradients"
DEEPSPEED = "accelerate.utils.deepspeed"
BACKWARD = "DeepSpeedEngineWrapper.backward"
FINGERPRINTS = {
    (STATE, SET_SYNC): {"699ffb9913166c39": "0.20.0-0.27.2", "1549ff0bf1db58df": "0.28.0-1.7.0"},
    (DEEPSPEED, BACKWARD): {"15269979056b4911": "0.20.0-1.7.0"},
}


# Where accelerate's decision for the micro-step is kept: in GradientState's shared state, so that it goes when
# accelerate's state is reset (a new job in the same process starts with none)
DECISION = "_dspatch_deepspeed_boundary"


def apply(txn):
    import itertools
    import weakref

    numbers = itertools.count(1)  # tells decisions apart
    seen = []  # GradientState's shared storage, once a decision was written there
    taken = weakref.WeakKeyDictionary()  # engine -> the number of the decision it took (each engine takes each once)

    def record(wrapped, state, args, kwargs):
        result = wrapped(*args, **kwargs)
        state.__dict__[DECISION] = (bool(state.sync_gradients), state.num_steps, next(numbers))
        seen[:] = [state.__dict__]
        return result

    def boundary_first(wrapped, wrapper, args, kwargs):
        engine = wrapper.engine
        decision = seen[0].get(DECISION) if seen else None
        # only where both count the same window: accelerate < 1.8 does not copy a GA that the DeepSpeed config alone
        # sets (accelerate's own stays 1), and there DeepSpeed's count is the one the job means
        if decision and taken.get(engine) != decision[2] and decision[1] == engine.gradient_accumulation_steps():
            taken[engine] = decision[2]
            engine.set_gradient_accumulation_boundary(decision[0])
        return wrapped(*args, **kwargs)

    txn.wrap(txn.target(SET_SYNC), record)
    txn.wrap(txn.target(BACKWARD), boundary_first)


PATCH = Patch(
    id="accelerate/deepspeed-ga-boundary",
    summary=("accelerate + DeepSpeed under accelerator.accumulate: DeepSpeed steps where accelerate's accumulation "
             "ends, so windows no longer straddle epochs and the last partial window is applied (silent)"),
    cause="DeepSpeed counts its own accumulation steps and ignores where accelerate's windows end",
    canary=('windows',),
    symptom="accumulation windows silently straddle epochs; the last partial one is never applied",
    distribution="accelerate",
    affected="<1.8.0",
    fixed_in="1.8.0",
    supported=">=0.20.0",
    requires={"deepspeed": ">=0"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/accelerate/pull/3630", "https://github.com/huggingface/accelerate/issues/3552",
           "https://github.com/huggingface/accelerate/issues/1970"),
    diffs=("accelerate/0004-deepspeed-ga-boundary-0.20.0-0.27.2.patch",
           "accelerate/0004-deepspeed-ga-boundary-0.28.0-1.7.0.patch"),
    note=("GradientState._set_sync_gradients and DeepSpeedEngineWrapper.backward are wrapped: the sync_gradients "
          "accelerate set for a micro-step becomes DeepSpeed's accumulation boundary before its backward"),
)
