"""An engine dropped without `destroy()` frees its model (deepspeed 0.14.0-0.19.6).

`DeepSpeedEngine.__init__` calls `deepspeed.utils.debug.debug_extract_module_and_param_names(model)`, which puts every
module and parameter of the model, as keys, in two module-level dicts of `deepspeed/utils/debug.py` (the names
DeepSpeed's debug messages print); only `engine.destroy()` empties them. So the model of the last engine built (with its
parameters and what hangs on them: gradients, a value head, a reference model's weights) stays alive after its engine
and every reference of the user's are gone: a notebook, a sweep or an evaluation loop that drops engines without
`destroy()` holds on to one model it can never reach. Fixed upstream in 0.19.7 (issue 8353), which keys those maps on
the objects' ids and drops an entry when its object dies.

The fix does the same: the extraction function is rebuilt from the installed source with each of its two dict
comprehensions passed to `weak_names` (this module), a mapping with the dict's `in` and `[]` that holds no reference to
its keys (keyed by id, each entry dropped when its object dies); the debug messages read it unchanged. Only at
`deepspeed.initialize`, once; nothing per step. Tested at ZeRO stages 0 and 2 on the old, mid and bridge stacks: a model
whose engine was dropped is freed by `gc.collect()`, ten 8 MB models built and dropped in a loop leave nothing behind
(stock keeps the last one), and the debug names still work.

Left alone, seen while checking (each with its own cause, not this small change); call `engine.destroy()` there:
- at ZeRO-3 every release 0.14.4-0.19.8 keeps every root module in `parameter_offload.FWD_MODULE_STACK`, a module-level
  list that `setup_zero_stage3_hooks` appends to and nothing shortens, so ZeRO-3 models are never freed, `destroy()` or
  not;
- deepspeed 0.19.8 keeps ZeRO-1/2 engines (and so their models) alive through the gradient hooks it registers on the
  parameters, whose closures hold the optimizer: a cycle through torch's C++ hook storage that Python's collector cannot
  see.
"""
import weakref

from dspatch.spec import Patch

DEBUG = "deepspeed.utils.debug"
EXTRACT = "debug_extract_module_and_param_names"
FINGERPRINTS = {(DEBUG, EXTRACT): {"161b8643e5dbb803": "0.14.0-0.19.6"}}


class WeakNames:
    """{object: name} for the debug messages, without keeping the objects alive: keyed by id(), each entry
    dropped by a finalizer when its object dies (a WeakKeyDictionary cannot be used: comparing two tensors for
    equality gives a tensor, not a bool)."""

    def __init__(self, pairs=()):
        self._names, self._finalizers = {}, {}
        for obj, name in dict(pairs).items():
            self[obj] = name

    def __setitem__(self, obj, name):
        key = id(obj)
        old = self._finalizers.pop(key, None)
        if old is not None:
            old.detach()
        self._names[key] = name
        self._finalizers[key] = weakref.finalize(obj, self._forget, key)

    def _forget(self, key):
        self._names.pop(key, None)
        self._finalizers.pop(key, None)

    def __getitem__(self, obj):
        return self._names[id(obj)]

    def __contains__(self, obj):
        return id(obj) in self._names

    def __len__(self):
        return len(self._names)


def weak_names(mapping):
    """What the rebuilt extraction stores instead of its dict comprehension's dict."""
    return WeakNames(mapping)


def names_held_weakly(definition):
    """Transform: `module_names = {...}` / `param_names = {...}` -> the same dict passed to weak_names()."""
    import ast

    from dspatch.rewrite import call_into, expression, find_all

    sites = find_all(definition, lambda n: isinstance(n, ast.Assign) and isinstance(n.value, ast.DictComp)
                     and [getattr(t, "id", None) for t in n.targets] in (["module_names"], ["param_names"]))
    if sorted(site.targets[0].id for site in sites) != ["module_names", "param_names"]:
        from dspatch.rewrite import RewriteError

        raise RewriteError(f"{definition.name}: expected `module_names = {{...}}` and `param_names = {{...}}`")
    for site in sites:
        call = expression(f"{call_into(__name__, 'weak_names')}(_)", site.value)
        call.args[0] = site.value
        site.value = call


def apply(txn):
    txn.recode(txn.target(EXTRACT), names_held_weakly)


PATCH = Patch(
    id="deepspeed/engine-releases-model",
    summary=("A DeepSpeed engine dropped without destroy() frees its model: the debug name maps of "
             "deepspeed/utils/debug.py no longer keep the last model alive"),
    cause="DeepSpeed's debug name maps keep a reference to the last engine's model",
    symptom="a dropped engine's model stays in memory unless `destroy()` was called",
    distribution="deepspeed",
    affected="<0.19.7",
    fixed_in="0.19.7",
    supported=">=0.14.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/8353",),
    diffs=("deepspeed/0009-engine-releases-model-0.14.0-0.16.9.patch",
           "deepspeed/0009-engine-releases-model-0.17.0-0.19.6.patch"),
    note=("deepspeed.utils.debug's name extraction keeps its object, name and line numbers but runs code rebuilt "
          "from the installed file that stores the names in weak maps (this patch's WeakNames)"),
)
