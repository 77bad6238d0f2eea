"""ZeRO-2/3 checkpoints name parameters as they are at save/load time, not by the objects seen at initialize.

`DeepSpeedEngine.__init__` builds `self.param_names = {param: name}` from the model once, keyed by the Parameter
*object*, and hands that same dict to its ZeRO/BF16 optimizers. Anything that puts a new Parameter object in the model
afterwards (accelerate's `set_module_tensor_to_device`, which `dispatch_model` onto several devices or with offload
uses; plain `module.weight = nn.Parameter(...)`) leaves a key that no longer is in the model and a parameter that has no
key: at ZeRO >= 2 `save_checkpoint` (and accelerate's `save_state`) then raises `ValueError: failed to find frozen
Parameter containing: ... in named params` (`_get_zero_frozen_param_attributes`), and so does `load_checkpoint` into
such a model (`load_module_state_dict`); the replaced tensor stays referenced by the stale key forever. A *trainable*
parameter replaced that way is worse: the optimizer keeps updating the old tensor, so the new one silently stops
training, and a save writes the old values under its name. Every release 0.14.0-0.19.8 checked; DeepSpeed issue 6620, PR
6626 open and unmerged (the thread snapshot available here shows the issue closed, yet 0.19.8's source fails exactly
so). Open upstream: the fingerprints of every release gate it.

The fix: just before the three functions read `self.param_names`, it is brought up to date with
`self.module.named_parameters()` *in place* (the optimizers share the same dict object, so they see it too): keys of
frozen parameters that left the model are dropped (the replaced tensor can be freed), parameters that have no key get
their current name. `_get_zero_param_shapes` (every save at ZeRO >= 1) and `load_module_state_dict` (every load) also
check that each parameter the optimizer owns is still the model's parameter of that name, and raise a `RuntimeError`
naming it and saying what to do when one was replaced. When nothing was replaced the dict is left untouched
(bit-identical checkpoints), and round trips are exact. Cost: one `named_parameters()` walk per save/load call, nothing
per step.

How: each target is rebuilt from the installed source (`txn.recode`) with one statement added at the top of its body, a
call of `refresh(self, ...)` from this module (builtins only: nothing is added to deepspeed).

Known limits: at ZeRO-3 a replacement must itself be a ZeRO-3 parameter (made by a module built under
`deepspeed.zero.Init`); a plain `nn.Parameter` cannot work there in any release. The replaced tensor is freed at the
next save or load, not at the moment of replacement.

Upstream PR 6626 (open, unmerged) could not be read for this patch: neither its diff nor its branch is in the reference
corpus available here (only issue 6620's thread is, where the reporter proposed iterating
`self.module.named_parameters()` inside `_get_zero_frozen_param_attributes` and a maintainer answered that DeepSpeed
needs `param_names` to know every parameter). This patch goes further than that proposal, on purpose: it keeps
`param_names` itself (the dict the ZeRO/BF16 optimizers hold) current instead of bypassing it in one function, so the
optimizers' lookups (universal checkpoints) and the load path agree with the save path and no stale key pins a replaced,
possibly offloaded, tensor; it covers `load_module_state_dict` too; and it turns the silent case (a replaced *trainable*
parameter) into an error instead of saving the old tensor's values under its name. The upstream form is
`upstream_prs/deepspeed/0004-*.patch` (a `_refresh_param_names` method called from the same three places).
"""

from dspatch.spec import Patch, Signature

ENGINE = "deepspeed.runtime.engine"
FROZEN = "DeepSpeedEngine._get_zero_frozen_param_attributes"
SHAPES = "DeepSpeedEngine._get_zero_param_shapes"
LOAD = "DeepSpeedEngine.load_module_state_dict"

# Bands of released source (tests/test_releases.py recomputes them from every sdist)
FINGERPRINTS = {
    (ENGINE, FROZEN): {"f8648b2df42741a6": "0.14.0-0.19.7", "7601ced6e8d95847": "0.19.8"},
    (ENGINE, SHAPES): {"0bb52408fd2b44fc": "0.14.0-0.17.4", "a4faa6cfee2f790a": "0.17.5-0.19.8"},
    (ENGINE, LOAD): {"1788f30970debe90": "0.14.0-0.19.2", "16d610a68612a873": "0.19.3-0.19.7",
                     "a0fe438ee5c1ff72": "0.19.8"},
}

REPLACED = ("parameter '{name}' was replaced by a new tensor object after deepspeed.initialize, but it is "
            "trainable: DeepSpeed's optimizer still holds and updates the old tensor, so '{name}' is no longer "
            "trained and a checkpoint would not hold its values. Change its values in place instead (under "
            "torch.no_grad(): `param.data.copy_(new)`; at ZeRO-3 inside deepspeed.zero.GatheredParameters), "
            "freeze it before replacing it, or replace it before deepspeed.initialize.")


def refresh(engine, check=True, update=True):
    """Bring `engine.param_names` (the dict DeepSpeed shares with its optimizers) up to date with the model, in
    place (`update`); with `check`, first raise if a trainable parameter (the optimizer's) was replaced."""
    names = engine.param_names
    module = engine.module
    if type(module).__name__ == "CompiledModuleWrapper":  # 0.14.0-0.14.2 with "compile" on: the model's own names
        module = vars(module).get("wrapped", module)
    current = dict(module.named_parameters())
    ids = {id(p) for p in current.values()}
    if len(names) == len(current) and all(id(p) in ids for p in names):
        return  # nothing was replaced: leave the dict exactly as upstream built it
    stale = [(param, name) for param, name in names.items() if id(param) not in ids]
    for param, name in stale:
        new = current.get(name)
        if check and new is not None and (param.requires_grad or new.requires_grad):
            raise RuntimeError(REPLACED.format(name=name))
    if not update:
        return
    for param, name in stale:
        if not param.requires_grad:  # a frozen parameter that left the model: nothing may keep it alive
            del names[param]  # (a trainable one stays: the optimizer still owns and looks up that object)
    for name, param in current.items():
        if param not in names:
            names[param] = name


def _refresh_first(definition):
    """Transform: `<this module>.refresh(self, <flags>)` as the first statement of the definition's body."""
    import ast

    from dspatch.rewrite import RewriteError, call_into, find_all, statement

    if not definition.args.args or definition.args.args[0].arg != "self":
        raise RewriteError(f"{definition.name}: expected a method of DeepSpeedEngine")
    if not find_all(definition, "self.param_names"):
        raise RewriteError(f"{definition.name}: does not read self.param_names")
    # saving: _get_zero_param_shapes (first) checks the optimizer's parameters, _get_zero_frozen_param_attributes
    # renames the frozen ones; loading: load_module_state_dict does both
    flags = {SHAPES: "update=False", FROZEN: "check=False", LOAD: ""}[f"DeepSpeedEngine.{definition.name}"]
    body = definition.body
    first = 1 if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                  and isinstance(body[0].value.value, str)) else 0  # after a docstring
    # at the first line of upstream's body
    body.insert(first, statement(f"{call_into(__name__, 'refresh')}(self, {flags})", body[first]))


def apply(txn):
    for target in txn.patch.targets:
        txn.recode(target, _refresh_first)


PATCH = Patch(
    id="deepspeed/frozen-param-names",
    summary="ZeRO-2/3 save/load after a parameter object was replaced (accelerate dispatch): names looked up at use",
    cause="ZeRO-2/3 keep the parameter objects seen at initialize and cannot name one that was replaced since",
    symptom="`ValueError: failed to find frozen Parameter containing: ... in named params` at save/load",
    distribution="deepspeed",
    affected=">=0",  # open upstream: no fixed release, the fingerprints decide
    fixed_in=None,
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6620",
           "https://github.com/deepspeedai/DeepSpeed/pull/6626"),
    supported=">=0.14.0",
    # one diff per band of releases whose files differ around the change (each applies as it is); the last
    # is the one to forward upstream
    diffs=("deepspeed/0004-engine-param-names-at-checkpoint-time-0.14.0-0.19.2.patch",
           "deepspeed/0004-engine-param-names-at-checkpoint-time-0.19.3-0.19.7.patch",
           "deepspeed/0004-engine-param-names-at-checkpoint-time-0.19.8.patch"),
    signatures=(Signature(r"failed to find frozen ", error="ValueError"),),
    note=("open upstream (issue 6620; PR 6626 unmerged): gated by the source of its targets, not by a release. "
          "Three DeepSpeedEngine checkpoint methods keep their objects, names and line numbers but run code rebuilt "
          "from the installed file with one added first statement that refreshes engine.param_names"),
)
