"""A second `deepspeed.initialize` on what a live engine holds: refused where it would corrupt it, else a warning.

No release (0.14.0-0.19.8) checks whether the model, or the client optimizer, given to `deepspeed.initialize` is already
in use by an engine. A second call installs DeepSpeed's state on the same objects a second time. What that does on
stock, seen on CPU with the real code (a 2-layer MLP; the first engine trained two steps, then the second call; "first
engine" = its next steps compared bit for bit with an identical engine that saw no second call, between engines that are
not the first of their process; every row is a test, dspatch/patches/deepspeed/initialize_once/test_initialize_once.py::test_table):

| second call (first engine's ZeRO stage -> second's) | deepspeed 0.14.4 (and 0.16.3) | deepspeed 0.19.8 |
|---|---|---|
| same model, 0 -> 0 and 1 -> 1 | both engines train; first unchanged | same |
| same model, 2 -> 2 (gradient hooks registered twice) | first engine's next step: `AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute 'ipg_index'` | first unchanged until the second engine's first backward: `AssertionError: The parameter ... has already been reduced`; the first fails the same way from then on |
| same model, 3 -> 3 (parameters partitioned twice) | first unchanged until the second engine's first step fails (`AssertionError`), then the first fails too | same |
| same model, 0 -> 3 (the first engine's parameters partitioned under it) | first engine's next forward: `RuntimeError: The size of tensor a (0) must match ...` | same |
| the engine passed as the model, 2 -> 2 / 3 -> 3 | as "same model" | first unchanged; the second engine's first step: `AttributeError: 'NoneType' object has no attribute 'view'` / `... 'numel'` |
| same client optimizer, ZeRO 1 or 2 (param_groups pruned and regrouped in place) | the second call raises `KeyError` part-way, after changing the shared optimizer; the first engine's losses change | same (with the same model passed again, the first engine fails: `no attribute 'engine_timers'`, hooks of the half-built second engine) |
| same client optimizer, ZeRO 3 | the second call raises `IndexError` part-way; the first engine fails | same |
| same client optimizer, ZeRO 0 | both engines train; first unchanged | same |
| a different model, any stage | allowed (DeepSpeed-Chat builds four engines) | same |
| same model after `first.destroy()` (ZeRO-2) | allowed, the new engine trains | same |
| same model, the first an inference engine (no optimizer) at ZeRO-3 that ran one forward, 3 -> 3 | 0.14.4: both train; 0.16.3: the second engine's first forward: `IndexError: pop from an empty deque` | same as 0.16.3 |
| same model, the first an inference engine that ran two forwards, 3 -> 3; or at ZeRO-0, 0 -> 2 / 0 -> 3 | the second engine trains as if the first had never been | same |

(Re-initializing a destroyed ZeRO-3 model fails on stock 0.16.3 with `pop from an empty deque`, patched or not: not
something dspatch allows or refuses.)

The inference rows are what trl 1.9-1.16 (reference log-probs precomputed under DeepSpeed, `prepare_deepspeed`) and the
Trainer (`evaluate()` before `train()`) do: an engine with no optimizer runs forwards, then the training engine is built
on the same model. That is not a second training engine, and it trains on stock (but for the deque after a single ZeRO-3
forward), so it is never refused, and goes through exactly as on stock. Taking the inference engine off the model is its
caller's to do, before the next engine is built: dspatch's trl/precompute-ref-zero3-engine and
transformers/trainer-stale-deepspeed-engine do it for trl and the Trainer (dspatch/patches/engine_handover.py). Done here
instead, inside the second `deepspeed.initialize`, it broke a run that trains on stock: LoRA DPO with a precomputed
reference and gradient checkpointing at ZeRO-3 then fails in backward (`CheckpointError`: weights recomputed with shape
[0], deepspeed 0.19.8), where with the inference engine left alone it trains.

So with the patch, before the call reaches DeepSpeed:
- the model (or an engine passed as the model) or the client optimizer is owned by a live engine and either that engine
  or the new call uses gradient hooks or partitioning (ZeRO stage >= 2, stage 1 with `overlap_comm`), or the optimizer
  is shared at ZeRO >= 1, or the new call's ZeRO stage cannot be read (a config that is neither a dict nor a JSON file),
  or a ZeRO-3 inference engine's partitions would be handed to a non-ZeRO-3 engine: `InitializeTwiceError` (a
  `RuntimeError`) naming the object, the live engine, its stage and the code that built it (the first frame outside
  deepspeed, e.g. `accelerate/accelerator.py:1980 in _prepare_deepspeed` or `trl/models/utils.py:287 in
  prepare_deepspeed`), and what to do (keep the first engine, `destroy()` it first, or pass a fresh copy). Nothing has
  changed; the first engine trains on bit-identically.
- the live engine holding the model is an inference engine (built with no optimizer, given or configured), and the new
  call does not leave ZeRO-3 partitions under a non-ZeRO-3 engine: through, silently, as on stock.
- otherwise (ZeRO 0/1 without hooks on both sides, harmless): one `UserWarning` per process, and the call goes through
  as stock.
- different models, and a model whose engine was `destroy()`ed (or garbage-collected), pass silently.

Ownership is kept in this module as weak references keyed by `id()` (checked with `ref() is obj`), never on the user's
objects: a marker attribute (upstream PR 6874 sets `ds_is_inited = True`) would be copied by `copy.deepcopy(model)` and
pickled with it, so a deep copy made for a reference/EMA model would be refused, and it stays set after `destroy()`.
Weak references keep nothing alive and are gone with the engine.

Targets: `deepspeed.initialize` (wrapped: one check per call, nothing per step) and `DeepSpeedEngine.destroy` (wrapped:
forgets the engine's ownership after a successful destroy). The wrap replaces the attribute of the `deepspeed` module,
so it covers callers that look it up at call time: `deepspeed.initialize(...)` (scripts, DeepSpeed-Chat, trl's
`prepare_deepspeed`, accelerate 0.34.2 `deepspeed.initialize(**kwargs)` and 1.x `ds_initialize = deepspeed.initialize`
inside `_prepare_deepspeed`, transformers through accelerate). A `from deepspeed import initialize` bound *before* the
patch applied keeps the stock function (with `DSPATCH=1` the patch applies when `deepspeed` finishes importing, before
any user code can bind it). Engines created before a late `dspatch.apply()` are unknown to the guard.

Upstream: DeepSpeed issue 6772, and PR 6874 (open), which raises on any second call with a marked object, including the
harmless ZeRO-0/1 cases and after `destroy()`, and marks the objects themselves (copied by deepcopy, see above). This
patch refuses exactly where the table shows corruption, warns elsewhere, and forgets an engine on `destroy()`. Not
covered: two *different* model objects sharing parameters (tied modules passed separately).
"""
from dspatch.patches.deepspeed.initialize_once.stages import has_hooks, read_config, stage_of_config, stage_of_engine
from dspatch.spec import Patch

INIT = ("deepspeed", "initialize")
DESTROY = ("deepspeed.runtime.engine", "DeepSpeedEngine.destroy")

# every release 0.14.0-0.19.8 (tests/test_releases.py recomputes them from the sdists)
FINGERPRINTS = {
    INIT: {"aa0062168c52732e": "0.14.0", "f586614c862a60da": "0.14.1-0.14.5", "64d29b1daff4230e": "0.15.0-0.17.5",
           "4c161e7ef684c323": "0.17.6-0.18.5", "148baa742917d32c": "0.18.6-0.19.2",
           "6e59cafa98b5f5f3": "0.19.3-0.19.7", "707119702bbc59d2": "0.19.8"},
    DESTROY: {"2b6d8adde43ee512": "0.14.0-0.16.5", "cb369d749f50644b": "0.16.6-0.17.0",
              "067793bb7bdcac28": "0.17.1-0.17.6", "47e692d46cdd1c84": "0.18.0-0.18.4",
              "1f79862f7d57ec45": "0.18.5-0.19.3", "1d1da7507a510d2e": "0.19.4-0.19.6", "11eec80a9298544b": "0.19.7",
              "4fe7c15000176806": "0.19.8"},
}

PID = "deepspeed/initialize-once"
REFUSED = "deepspeed.initialize refused before changing anything"


class InitializeTwiceError(RuntimeError):
    """A second deepspeed.initialize on an object a live engine holds, where it would corrupt that engine."""


# id(obj) -> (weakref to obj, weakref to engine, what: "model" | "engine" | "optimizer", the code that built it)
_owners: dict = {}
_warned: list = []


def _remember(obj, engine, what, built_by):
    import weakref

    if obj is None:
        return
    key = id(obj)
    try:
        ref = weakref.ref(obj, lambda _, key=key: _forget_key(key))
    except TypeError:  # not weak-referenceable: not tracked
        return
    _owners[key] = (ref, weakref.ref(engine), what, built_by)


def _caller():
    """Where deepspeed.initialize was called from: the first frame outside deepspeed, wrapt and dspatch, as
    `package/module.py:line in function` (a script: its file name), or None."""
    import os
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name.partition(".")[0] not in ("deepspeed", "wrapt", "dspatch"):
            where = (name.replace(".", "/") + ".py") if name and name != "__main__" else \
                os.path.basename(frame.f_code.co_filename)
            return f"{where}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _forget_key(key):
    entry = _owners.get(key)
    if entry is not None and entry[0]() is None:
        del _owners[key]


def _forget_engine(engine):
    for key, (_, owner, _, _) in list(_owners.items()):
        if owner() is engine or owner() is None:
            _owners.pop(key, None)


def _owner(obj):
    """(engine, what, built_by) of a live engine holding `obj`, or None."""
    entry = _owners.get(id(obj)) if obj is not None else None
    if entry is None or entry[0]() is not obj:
        return None
    engine = entry[1]()
    return None if engine is None else (engine, entry[2], entry[3])


def _describe(obj):
    return f"{type(obj).__name__} at {hex(id(obj))}"


def _check(model, optimizer, args, config, config_params):
    """Raise InitializeTwiceError where a second call would corrupt a live engine; return a warning text where
    it is harmless; None when nothing is reused (or only an inference engine's model, which goes through as on
    stock)."""
    from dspatch.patches import engine_handover

    new = stage_of_config(read_config(args, config, config_params))
    new_text = f"ZeRO stage {new[0]}" if new else "a ZeRO stage this check cannot read (not a dict or a JSON file)"
    harmless = []
    for obj, role in ((model, "model"), (optimizer, "optimizer")):
        found = _owner(obj)
        if found is None:
            continue
        engine, what, built_by = found
        old = stage_of_engine(engine)
        if role == "model" and what == "model" and engine_handover.is_inference(engine) and (
                not engine_handover.partitions(engine) or (new is not None and new[0] == 3)):
            continue  # an inference engine's forwards are done: no second training engine (see the docstring)
        old_text = f"ZeRO stage {old[0]}" if old else "an unknown ZeRO stage"
        kind = "inference engine (no optimizer) " if engine_handover.is_inference(engine) else ""
        subject = ("this DeepSpeedEngine (passed as the model)" if what == "engine" else f"this {role}") \
            + f" ({_describe(obj)})"
        if role == "model":
            corrupting = has_hooks(old) or has_hooks(new)
            why = ("would install DeepSpeed's per-parameter state on the same parameters again (ZeRO-2 gradient "
                   "hooks registered twice, ZeRO-3 parameters partitioned twice), which breaks both engines")
            if kind and old is not None and old[0] == 3:
                why = "would train parameters that a ZeRO-3 engine partitioned without ZeRO-3's hooks to gather them"
        else:
            corrupting = old is None or new is None or old[0] >= 1 or new[0] >= 1
            why = ("would prune and regroup the optimizer's param_groups in place again, which changes the "
                   "first engine's optimizer")
        where = (f"is already in use by a live {type(engine).__name__} {kind}({hex(id(engine))}, {old_text}"
                 f"{f', built by {built_by}' if built_by else ''})")
        if corrupting:
            raise InitializeTwiceError(
                f"{REFUSED}: {subject} {where}. A second initialize with {new_text} {why}. Keep training with "
                f"the engine you have (it is unchanged), or call its destroy() before initializing again, or pass "
                f"a new {role} (e.g. a copy.deepcopy made before the first initialize). [dspatch {PID}]")
        harmless.append(f"{subject} {where}")
    if harmless:
        return (f"deepspeed.initialize: {'; '.join(harmless)}. At {new_text} this is harmless, but both engines "
                f"now share the same parameters and each steps them. [dspatch {PID}; shown once]")
    return None


def _bind(wrapped, args, kwargs):
    import inspect

    try:
        bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = dict(kwargs)
    return bound


def _initialize(wrapped, instance, args, kwargs):
    bound = _bind(wrapped, args, kwargs)
    model, optimizer = bound.get("model"), bound.get("optimizer")
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = None  # a callable that builds one is fresh each time
    warning = _check(model, optimizer, bound.get("args"), bound.get("config"), bound.get("config_params"))
    if warning is not None and not _warned:
        import warnings

        _warned.append(True)
        warnings.warn(warning, UserWarning, stacklevel=3)
    built_by = _caller()
    result = wrapped(*args, **kwargs)
    try:
        engine = result[0]
    except Exception:
        return result
    _remember(engine, engine, "engine", built_by)
    if model is not engine:
        _remember(model, engine, "model", built_by)
    _remember(optimizer, engine, "optimizer", built_by)
    return result


def _destroy(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if instance is not None:
        _forget_engine(instance)
    return result


def apply(txn):
    txn.wrap(txn.target(INIT[1]), _initialize)
    txn.wrap(txn.target(DESTROY[1]), _destroy)


PATCH = Patch(
    id=PID,
    summary=("A second deepspeed.initialize on a model/optimizer a live engine holds is refused before it "
             "corrupts that engine (ZeRO-2 hooks, ZeRO-3 partitions, optimizer groups); harmless reuse warns once"),
    cause=("A second `deepspeed.initialize` on a model or optimizer a live engine holds rewires them under the "
           "first engine"),
    symptom="the first engine breaks: `no attribute 'ipg_index'`, `has already been reduced`, `KeyError`",
    distribution="deepspeed",
    affected=">=0",  # open upstream in every release: the fingerprints decide
    fixed_in=None,
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6772",
           "https://github.com/deepspeedai/DeepSpeed/pull/6874"),
    supported=">=0.14.0",
    # one diff per band of releases whose files differ around the insertion points (each applies as it is); the
    # last one is the one to forward upstream
    diffs=("deepspeed/0005-initialize-once-0.14.0-0.14.3.patch",
           "deepspeed/0005-initialize-once-0.14.4.patch",
           "deepspeed/0005-initialize-once-0.14.5.patch",
           "deepspeed/0005-initialize-once-0.15.0-0.16.3.patch",
           "deepspeed/0005-initialize-once-0.16.4-0.16.5.patch",
           "deepspeed/0005-initialize-once-0.16.6-0.17.0.patch",
           "deepspeed/0005-initialize-once-0.17.1-0.17.6.patch",
           "deepspeed/0005-initialize-once-0.18.0-0.18.4.patch",
           "deepspeed/0005-initialize-once-0.18.5-0.19.3.patch",
           "deepspeed/0005-initialize-once-0.19.4-0.19.6.patch",
           "deepspeed/0005-initialize-once-0.19.7.patch",
           "deepspeed/0005-initialize-once-0.19.8.patch"),
    note=("deepspeed.initialize and DeepSpeedEngine.destroy are wrapped: one ownership check per initialize "
          "(weak references, nothing stored on your objects), nothing per step"),
)
