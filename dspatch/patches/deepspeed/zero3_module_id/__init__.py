"""ZeRO-3 overwrites a user's `module.id`; DeepSpeed's counter moves to `ds_id`, upstream's name since 0.16.4.

DeepSpeed <= 0.16.3 numbers every submodule with `module.id = n` when it registers its ZeRO-3 hooks, and its parameter
coordinator keys its fetch/release bookkeeping on `module.id`. So (a) a model's own `.id` (expert placement in MoE
models) is overwritten at `deepspeed.initialize`, and (b) code that sets `.id` afterwards, during training, corrupts
that bookkeeping: `IndexError: pop from an empty deque` while the prefetch trace is recorded. Upstream renamed the
attribute to `ds_id` in 0.16.4 (PR 6847; issue 6772).

The patch makes the same rename, to the same name, so code written for newer releases behaves the same, in all nine
functions that write or read it: every function of the package that touches `.id` in every affected release but one,
`deepspeed/utils/debug.py:debug_module2name_id`, dead code that nothing calls and that upstream's own fix left alone too
(a test checks the whole package of each release). And (c) it refuses, with a clear `ValueError`, to overwrite a `ds_id`
that DeepSpeed did not set, instead of clobbering it silently: a check written into the registration itself, which also
remembers DeepSpeed's own number on the module, so that a re-registration (`unwrap_model_for_generation`, a deepcopy or
a pickle of a ZeRO-3 model) is recognised.

How: each of the nine functions is recompiled in place from the installed source with that one rename (and, in the
registration, the guard). No wrapper: a step runs upstream's bytecode with one attribute name changed, and upstream's
decorators and anyone else's wrapper around these functions keep calling them.

Refused: engines built before the patch number their modules with `.id`, after it with `.ds_id`, so a late
`dspatch.apply()`, or a revert, while a ZeRO-3 engine exists in the process is refused (DeepSpeed keeps every engine
reachable, so any engine ever built counts). Apply dspatch before the first `deepspeed.initialize` (`DSPATCH=1`, or
`dspatch.apply()` first).
"""
import sys

from dspatch.spec import Patch, Signature

# where ZeRO-3's trace bookkeeping pops its deque (the message alone is any deque's)
COORDINATOR_FRAME = r"partitioned_param_coordinator\.py|__step_id_module_fetched_for"

OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
REGISTER = "DeepSpeedZeRoOffload._register_hooks_recursively"

# Every function that reads or writes a module's `.id`, and the fingerprint of its source in the releases
# it was written for (tests/test_releases.py recomputes them from every release).
FINGERPRINTS = {
    (OFFLOAD, REGISTER): {"beb1744112358e8d": "0.14.0-0.15.4", "90264bf624e8b96e": "0.16.0-0.16.3"},
    (OFFLOAD, "DeepSpeedZeRoOffload.post_sub_module_forward_function"): {
        "7afccceb166e3708": "0.14.0-0.15.3", "d7a3471a831c5bc1": "0.15.4-0.16.3"},
    (OFFLOAD, "DeepSpeedZeRoOffload.post_sub_module_backward_function"): {
        "483a804f440db6c9": "0.14.0-0.15.3", "0bcda9923f6b7887": "0.15.4-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.trace_prologue"): {"671af8104787b723": "0.14.0-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.record_module"): {
        "c61b4bbec50b6d40": "0.14.0-0.15.3", "000319a6f2e828d9": "0.15.4-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.record_parameters"): {
        "c812c79e33525a21": "0.14.0-0.15.3", "0e10b10459e8f2f4": "0.15.4-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.reset_step"): {
        "d23e10b499db8425": "0.14.0-0.15.2", "9ba045b30387dcb7": "0.15.3", "133925eb217f44bb": "0.15.4",
        "e5ccd7f4395a8d86": "0.16.0-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.fetch_sub_module"): {
        "ad5f05952de07385": "0.14.0-0.16.2", "9dac46dfd5c9c2fb": "0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.release_sub_module"): {
        "ed37e634a8658c6f": "0.14.0-0.16.2", "ecfd1cdcdc0a6544": "0.16.3"},
}


REFUSAL = ("{kind} already has an attribute ds_id={value!r} that DeepSpeed did not set. ZeRO-3 numbers modules "
           "with `ds_id` (upstream since deepspeed 0.16.4; dspatch deepspeed/zero3-module-id backports it) and "
           "would overwrite yours: rename that attribute.")


def _guard_ds_id(definition):
    """(c) Around `module.ds_id = my_count` in the registration (after the rename), refuse a `ds_id` that
    DeepSpeed did not assign, and remember DeepSpeed's own on the module (`_ds_id_assigned`), so that
    re-registration (unwrap_model_for_generation, a deepcopy or a pickle of a ZeRO-3 model) is recognised.
    Written into the rebuilt function itself: builtins only, no wrapper, no name added to deepspeed."""
    import ast

    from dspatch.rewrite import find_statement, statement

    body, i = find_statement(definition, "_.ds_id = _", "`module.ds_id = ...`")
    assign = body[i]
    m = ast.unparse(assign.targets[0].value)
    guard = statement(f"if hasattr({m}, 'ds_id') and not (type({m}.ds_id) is int and "
                      f"{m}.ds_id == getattr({m}, '_ds_id_assigned', None)):\n"
                      f"    raise ValueError({REFUSAL!r}.format(kind=type({m}).__name__, value={m}.ds_id))\n", assign)
    remember = statement(f"{m}._ds_id_assigned = {m}.ds_id", assign)
    body[i:i + 1] = [guard, assign, remember]


def to_ds_id(definition):
    from dspatch.rewrite import rename_attribute

    rename_attribute("id", "ds_id")(definition)
    if definition.name == REGISTER.rsplit(".", 1)[-1]:
        _guard_ds_id(definition)


def apply(txn):
    # Each target's own function object gets code rebuilt from the installed source with the rename (and,
    # in the registration, the guard). Nothing is replaced: upstream's decorators and anyone else's wrapper
    # around these functions keep calling them, and the per-step hot path runs exactly upstream's code.
    for target in txn.patch.targets:
        txn.recode(target, to_ds_id)


def zero3_engines_alive():
    """Engines built before the patch number their modules with `.id`, after it with `.ds_id`: switching
    while one may still be used would break it, so a late dspatch.apply() or a revert is refused. DeepSpeed
    keeps every engine reachable (utils/debug.py's module-name dicts), so any engine ever built counts."""
    import gc

    offload = sys.modules.get(OFFLOAD)
    if offload is None:
        return None
    # type() only: isinstance() would read `__class__`, a property on some objects (torch's reduce_op warns);
    # no gc.collect() either, which would run unrelated finalizers. Unreachable engines count: conservative.
    cls = offload.DeepSpeedZeRoOffload
    alive = sum(1 for o in gc.get_objects() if issubclass(type(o), cls))
    if alive:
        return (f"{alive} ZeRO-3 engine(s) exist in this process, numbered the other way; apply dspatch before "
                f"the first deepspeed.initialize (DSPATCH=1, or dspatch.apply() first)")
    return None


PATCH = Patch(
    id="deepspeed/zero3-module-id",
    summary="ZeRO-3 overwrites a user's module.id; DeepSpeed's counter moves to ds_id (upstream name since 0.16.4)",
    cause=("ZeRO-3 numbers every module in `module.id`, overwriting a model's own `id` attribute and breaking "
           "code that reads it"),
    symptom="`IndexError: pop from an empty deque`; a model's own `module.id` overwritten",
    distribution="deepspeed",
    affected="<=0.16.3",
    fixed_in="0.16.4",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6772",
           "https://github.com/deepspeedai/DeepSpeed/pull/6847"),
    supported=">=0.14.0",  # the oldest release fingerprinted and run; older ones cannot use the CPU accelerator
    # one diff per band of releases whose files differ around the change (each applies as it is)
    diffs=("deepspeed/0001-zero3-module-id-to-ds_id-0.14.0-0.15.3.patch",
           "deepspeed/0001-zero3-module-id-to-ds_id-0.15.4.patch",
           "deepspeed/0001-zero3-module-id-to-ds_id-0.16.0-0.16.2.patch",
           "deepspeed/0001-zero3-module-id-to-ds_id-0.16.3.patch"),
    # a frame that reads `ds_id` comes from 0.16.4 on, where this bug is fixed
    signatures=(Signature(r"pop from an empty deque", error="IndexError", context=(COORDINATOR_FRAME,),
                          unless=(r"\bds_id\b",),
                          tell="the model's modules have an attribute `id` of their own (deepspeed <= 0.16.3), "
                               "and nothing removed and re-registered ZeRO-3's hooks (no generation) before it",
                          # the real logs of this deque on deepspeed <= 0.15.3 (trl#1543, trl#1618) are trl's, and
                          # nothing in a traceback shows a model's own `id`: never named, only offered
                          also="trl 0.8.2-0.8.6's unwrap_model_for_generation (PPO's generation, or the context "
                               "manager used in another trainer) took ZeRO-3's hooks off with parameters still "
                               "in use; trl 0.9.2 clears them first (trl PR 1617)"),),
    in_use=zero3_engines_alive,
    fixed_marker=(OFFLOAD, "DeepSpeedZeRoOffload._register_deepspeed_module"),  # PR 6847's new name
    # every function of deepspeed that touches an attribute `.id`, in every release 0.14.0-0.16.3, is a target,
    # except this one, which upstream's own fix (0.16.4) left alone too
    renamed=("id", {"deepspeed/utils/debug.py:debug_module2name_id": "dead code: nothing calls it"}),
    note=("the nine functions keep their objects, names and line numbers but run code rebuilt from the installed "
          "file with `.id` read as `.ds_id`: inspect.getsource and debuggers show that file (`.id`), the code "
          "that runs uses `.ds_id`"),
)
