"""DeepSpeed's unfused fp16/bf16 optimizer allocates its optimizer's state without taking a step (every release;
found by `dspatch canary`).

`FP16_UnfusedOptimizer.__init__` calls `initialize_optimizer_states`, which gives every parameter a zero gradient and
calls the wrapped optimizer's `step()` to allocate its state. A step with zero gradients is not inert: Adam and AdamW
count it (`state["step"]` is 1 before training starts, so the first real update uses the bias correction of a second
step: 1/(1+beta1) * sqrt(1+beta2) = 0.744 times the first step it should be), and AdamW's decoupled weight decay
shrinks every weight by lr * weight_decay once. This optimizer wraps a client or torch optimizer at ZeRO stage 0
with fp16 (non-fused optimizers), and, since deepspeed 0.17.6 (PR 7515), with bf16: a Trainer or an engine at stage 0
in bf16 with torch's AdamW trains its first steps otherwise than plain torch's mixed precision does, silently.
ZeRO-1/2 and BF16_Optimizer no longer take such a step (PR 5104 proposes the same for every path; open upstream).
Written for 0.17.6 and later, where bf16 runs it and the CPU can prove it; an fp16 job on an older release (a GPU's)
has the same step, left as it is.

The fix makes the step inert, as the optimizers that allocate their state lazily would have it: while
`initialize_optimizer_states` runs, every param group's learning rate and weight decay are 0; after it, they are
restored and every state's step count is 0 again. The state stays allocated (a checkpoint loads into it as before).

Found by `dspatch canary` on the latest stack (ZeRO-0, bf16, torch AdamW: "the weights moved 0.7441x as far as the
optimizer the config means moves them"); proven by the canary's own comparison: on deepspeed >= 0.17.6 stock's first
update is 0.744 times plain torch's and the weights were decayed before it; patched, every step equals plain torch's
mixed precision.
"""
from dspatch.spec import Patch

UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer"
INIT = "FP16_UnfusedOptimizer.initialize_optimizer_states"
# every release 0.14.0-0.19.8 (python tests/upstream_releases.py deepspeed/unfused-optimizer-init-step 0.14.0 0.19.8)
FINGERPRINTS = {(UNFUSED, INIT): {"c26005a4cd181c4a": "0.14.0-0.19.8"}}


def _zero(value):
    import torch

    return torch.zeros_like(value) if torch.is_tensor(value) else 0


def inert_step(wrapped, instance, args, kwargs):
    """initialize_optimizer_states(self): its step moves nothing and counts nothing."""
    optimizer = instance.optimizer
    saved = [{key: group[key] for key in ("lr", "weight_decay") if key in group} for group in optimizer.param_groups]
    for group, kept in zip(optimizer.param_groups, saved):
        for key, value in kept.items():
            group[key] = _zero(value)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for group, kept in zip(optimizer.param_groups, saved):
            group.update(kept)
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] = _zero(state["step"])


def apply(txn):
    txn.wrap(txn.target(INIT), inert_step)


PATCH = Patch(
    id="deepspeed/unfused-optimizer-init-step",
    summary=("FP16_UnfusedOptimizer allocates its optimizer's state with an inert step: no Adam step counted, no weight "
             "decay applied before training (ZeRO-0 bf16 since 0.17.6, fp16 with torch optimizers)"),
    cause=("The unfused fp16/bf16 optimizer steps its optimizer once with zero gradients to allocate state: Adam counts "
           "the step and AdamW decays the weights"),
    symptom="ZeRO-0 bf16 with torch AdamW: the first update silently 0.744x plain torch's, weights decayed once",
    distribution="deepspeed",
    affected=">=0",
    fixed_in=None,
    supported=">=0.17.6",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/5104", "https://github.com/deepspeedai/DeepSpeed/pull/7515"),
    diffs=("deepspeed/0025-unfused-optimizer-init-step-0.17.6-0.19.8.patch",),
    canary=("adam_step_early",),
)
