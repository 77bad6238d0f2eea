"""ZeRO-3 + frozen weights + non-reentrant activation checkpointing trains instead of raising `CheckpointError`.

ZeRO-3 with frozen weights (LoRA, QLoRA) and non-reentrant gradient checkpointing (the default from transformers 5.0,
and on 4.x whenever `gradient_checkpointing_kwargs={"use_reentrant": False}` is passed) fails at the first backward with
`CheckpointError: Recomputed values for the following tensors have different metadata than during the forward pass` (a
frozen weight seen with shape `[0]`). In backward, torch's non-reentrant checkpoint recomputes a block's forward to get
its saved tensors back; that re-runs ZeRO-3's forward hooks, and the post-hook partitions every parameter of a submodule
in place (`param.data = torch.empty(0)`). torch keeps a live, undetached reference to a saved tensor that does not
require grad (`x.detach() if x.requires_grad else x`): a trainable weight is saved as a detached alias and keeps its
shape, a frozen one is the Parameter itself, so partitioning it shrinks the very tensor the recompute is about to
validate (and that the backward would read). Typical hit: `weight * hidden` in an RMSNorm of a LoRA model (a frozen
Linear saves `weight.t()`, a view, which is not affected). Every release 0.14.0-0.19.2 (five source bands); fixed
upstream in deepspeed 0.19.3 (PR 8148, building on PR 8130). Upstream threads: transformers issue 47254, trl issue 2514,
DeepSpeed issue 4332.

The fix (PR 8130's rule, which PR 8148 kept): a *forward* release that runs inside a backward pass (a checkpoint
recompute: `torch._C._current_graph_task_id() != -1`) leaves the submodule's frozen parameters gathered; the backward of
that submodule, which runs next, releases them as it releases everything else. Trainable parameters are released as
before (their memory profile is unchanged). Upstream PR 8148 also releases, at the end of the backward pass, frozen
parameters whose submodule backward never ran (a block input that does not require grad registers no post-backward hook;
on 0.16.0-0.16.7 a recomputed module's count of pending gradients keeps growing, so its post-backward release never runs
again); this patch does the same, as upstream's `release_backward_leftovers` does, with a callback queued once per
backward pass on torch's autograd engine, which runs the coordinator's own `release_sub_module` again for the submodules
whose held parameters are still gathered (it drops that submodule's own mark and releases only what no other submodule
uses). Losses and trained weights are bit-identical to reentrant checkpointing and to no checkpointing (tested, with
plain `torch.utils.checkpoint` and with a Trainer + peft LoRA).

How: one wrapper (wrapt) around `DeepSpeedZeRoOffload.post_sub_module_forward_function`, the forward-release hook, which
is the one place that knows a release is a forward one in every affected release (the coordinator's `release_sub_module`
has a `forward` flag only since 0.17.0). Inside a backward pass only, around the call it marks the submodule's gathered
frozen parameters `is_external_param` (the flag `release_sub_module` already skips, both in its release and in its
fast-sharding buffer swap) and puts the flag back right after. Outside a backward pass (every ordinary forward) the
wrapper only asks torch for the graph task id: nothing else runs, so a job that does not recompute is bit-identical to
stock.

Not the coordinator's code itself: deepspeed/zero3-module-id rebuilds `release_sub_module` (and this hook) from the
installed source on <= 0.16.3, and two rebuilds of one function do not compose (the second would start from the
installed source and drop the first, so dspatch refuses it); a wrapper composes with a rebuild in either order.
"""
from dspatch.spec import Patch, Signature

# a weight recomputed as ZeRO-3 leaves it between uses: partitioned, with shape [0]
PARTITIONED_RECOMPUTE = r"recomputed metadata: \{'shape': torch\.Size\(\[0\]\)"
FSDP = r"fully_sharded_data_parallel|torch[/\\]distributed[/\\]fsdp|\bFSDP"

OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
FORWARD_RELEASE = "DeepSpeedZeRoOffload.post_sub_module_forward_function"

# The forward-release hook's released source, by band (tests/test_releases.py
# recomputes them from every sdist).
FINGERPRINTS = {"7afccceb166e3708": "0.14.0-0.15.3", "d7a3471a831c5bc1": "0.15.4-0.16.3",
                "1d6b2192d969f6cb": "0.16.4-0.16.9", "a476dcf9d180069b": "0.17.0-0.18.0",
                "2dc4a478cb2eec93": "0.18.1-0.19.2"}

CHECKPOINT_ERROR = "Recomputed values for the following tensors have different metadata than during the forward pass"

_pending: dict = {}  # autograd graph task id -> {id(submodule): (offload, submodule, [frozen params held])}


def _coordinator(offload, module):
    get = offload.get_param_coordinator
    code = get.__func__.__code__
    if "training" in code.co_varnames[:code.co_argcount]:  # deepspeed <= 0.15.3
        return get(training=module.training)
    return get()


def _release_leftovers(task):
    """End of a backward pass: submodules whose backward never ran (no post-backward hook) still hold the frozen
    parameters the recompute gathered; release them as that backward would have."""
    for offload, module, held in _pending.pop(task, {}).values():
        if any(p.ds_status.name == "AVAILABLE" for p in held):  # (its own id may still mark them in use)
            _coordinator(offload, module).release_sub_module(module)


def hold_frozen_in_recompute(wrapped, instance, args, kwargs):
    import torch

    task = torch._C._current_graph_task_id()
    if task == -1:  # an ordinary forward: exactly upstream's call
        return wrapped(*args, **kwargs)
    module = args[0] if args else kwargs["sub_module"]
    held = [p for p in module.parameters() if not p.requires_grad and hasattr(p, "ds_status")
            and p.ds_status.name == "AVAILABLE" and not p.is_external_param]
    if not held:
        return wrapped(*args, **kwargs)
    for p in held:
        p.is_external_param = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        for p in held:
            p.is_external_param = False
        pending = _pending.get(task)
        if pending is None:
            pending = _pending[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _release_leftovers(task))
        pending[id(module)] = (instance, module, held)


def apply(txn):
    txn.wrap(txn.patch.targets[0], hold_frozen_in_recompute)


PATCH = Patch(
    id="deepspeed/zero3-frozen-checkpointing",
    summary=("ZeRO-3 + frozen weights (LoRA) + non-reentrant gradient checkpointing: CheckpointError (a frozen weight "
             "seen with shape [0]); frozen weights stay gathered through the recompute, as upstream since 0.19.3"),
    cause="ZeRO-3 releases frozen weights before non-reentrant checkpointing recomputes with them",
    symptom="`CheckpointError: Recomputed values ... have different metadata` (frozen weight, shape [0])",
    distribution="deepspeed",
    affected="<0.19.3",
    fixed_in="0.19.3",
    targets={(OFFLOAD, FORWARD_RELEASE): FINGERPRINTS},
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8148", "https://github.com/deepspeedai/DeepSpeed/pull/8130",
           "https://github.com/huggingface/transformers/issues/47254", "https://github.com/huggingface/trl/issues/2514",
           "https://github.com/deepspeedai/DeepSpeed/issues/4332"),
    supported=">=0.14.0",
    # one diff per band of releases whose parameter_offload.py differs around the change (each applies as it is)
    diffs=("deepspeed/0006-zero3-frozen-checkpointing-0.14.0-0.15.3.patch",
           "deepspeed/0006-zero3-frozen-checkpointing-0.15.4.patch",
           "deepspeed/0006-zero3-frozen-checkpointing-0.16.0-0.16.3.patch",
           "deepspeed/0006-zero3-frozen-checkpointing-0.16.4-0.16.9.patch",
           "deepspeed/0006-zero3-frozen-checkpointing-0.17.0-0.18.0.patch",
           "deepspeed/0006-zero3-frozen-checkpointing-0.18.1-0.19.0.patch",
           "deepspeed/0006-zero3-frozen-checkpointing-0.19.1-0.19.2.patch"),
    fixed_marker=("deepspeed.runtime.zero.partitioned_param_coordinator",
                  "PartitionedParameterCoordinator.release_backward_leftovers"),  # PR 8148's new method
    # torch's message for any recompute that differs (plain PyTorch, FSDP, ...): a ZeRO-3 partitioned weight
    # recomputed with shape [0] is this bug's own
    # (FSDP's sharded views can be empty too: not this bug)
    signatures=(Signature(r"(torch\.utils\.checkpoint: )?Recomputed values for the following tensors have different "
                          r"metadata than during the forward pass", error="CheckpointError",
                          needs=(PARTITIONED_RECOMPUTE,), unless=(FSDP,)),
                Signature(PARTITIONED_RECOMPUTE, unless=(FSDP,))),
    note=("DeepSpeedZeRoOffload.post_sub_module_forward_function is wrapped: inside a backward pass (a checkpoint "
          "recompute) the submodule's frozen parameters stay gathered until its backward (or the end of the "
          "backward pass) releases them; outside one, upstream's call as it is"),
)
