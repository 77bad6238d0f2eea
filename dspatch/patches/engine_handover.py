"""Hand a model over from a DeepSpeed inference engine whose work is done to the next engine built on it.

trl 1.9-1.16 (reference log-probs precomputed under DeepSpeed) and the Trainer (`evaluate()` before `train()`)
build an engine with no optimizer on the model, use it for forwards, and then build the training engine on the
same model while the first one is still alive. At ZeRO-3 the first engine's hooks stay on every submodule: its
parameter coordinator keeps replaying the trace it recorded, with module ids the second engine renumbered, and the
first training forward fails (`IndexError: pop from an empty deque`) when the first engine ran a single forward
(its trace still recording). Nothing else of the first engine matters once its forwards are done: its parameters
are the model's own, which the second engine partitions and gathers from then on.

`retire(engine)` takes such an engine out of the way: its own `destroy()` (ZeRO-3: the hooks of every submodule),
then the hook on the root module that `destroy()` leaves in releases 0.14.0-0.16.5 (`setup_zero_stage3_hooks`
registers it without keeping its handle: a post-forward hook up to 0.15.3, a pre-forward one from 0.15.4, which
resets the dead coordinator at every forward and so still fails the same way; 0.16.6 keeps and removes it). The
engine object stays usable: called again, its module runs under the next engine's hooks.

An inference engine without ZeRO-3 installs nothing on the module (its forward is the module's): retiring it
changes nothing, and it is not destroyed (nor could it be everywhere: bf16 at stage 0 with no optimizer fails in
0.16.x's BF16_Optimizer.destroy, which reads groups a DummyOptim never built). A training engine's optimizer holds
gradient hooks on the parameters below ZeRO-3 too: `training_too` destroys those (the Trainer's engine of an
earlier `train()`).
"""


def is_inference(engine):
    """Whether the engine was built with no optimizer at all (none given, none configured): it only runs forwards."""
    try:
        return engine.client_optimizer is None and not engine.optimizer_name()
    except Exception:  # not an engine this knows: it may train
        return False


def partitions(engine):
    """Whether the engine is a ZeRO-3 one (its hooks gather the parameters of every submodule)."""
    try:
        return engine.zero_optimization_stage() == 3
    except Exception:
        return False


def _closes_over(function, owners, depth=3):
    """Whether `function` (or a function it closes over, as DeepSpeed's instrument_w_nvtx wraps a hook) refers to
    one of `owners` in its closure."""
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if any(value is owner for owner in owners):
            return True
        if depth > 1 and callable(value) and _closes_over(value, owners, depth - 1):
            return True
    return False


def _root_hooks(module, owners):
    """(dict, key) of the root module's forward hooks whose function belongs to one of `owners`."""
    found = []
    for name in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(module, name, None) or {}
        found.extend((hooks, key) for key, function in hooks.items() if _closes_over(function, owners))
    return found


def retire(engine, training_too=False):
    """Take a ZeRO-3 engine's hooks off its module (see the module's docstring); with `training_too`, destroy a
    training engine below ZeRO-3 too; nothing for an inference engine below ZeRO-3."""
    if not partitions(engine):
        if training_too and not is_inference(engine):
            engine.destroy()
        return
    offload = getattr(engine, "optimizer", None)
    owners = [o for o in (offload, getattr(offload, "parameter_offload", None)) if o is not None]
    engine.destroy()
    module = getattr(engine, "module", None)
    for hooks, key in _root_hooks(module, owners) if module is not None and owners else ():
        hooks.pop(key, None)
        for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(module, extra, {}).pop(key, None)


def coordinators(engine):
    """The ZeRO-3 parameter coordinators of an engine (one from 0.15; 0.14 keeps one per training mode)."""
    offload = getattr(engine, "optimizer", None)
    offload = getattr(offload, "parameter_offload", offload)
    one = getattr(offload, "param_coordinator", None)
    return [one] if one is not None else list(getattr(offload, "param_coordinators", {}).values())


def forget_trace(engine):
    """Make a ZeRO-3 engine that stays on its model record its trace afresh at its next forward, instead of replaying
    (or completing) one recorded before another engine renumbered the model's modules."""
    if not partitions(engine):
        return
    for coordinator in coordinators(engine):
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
