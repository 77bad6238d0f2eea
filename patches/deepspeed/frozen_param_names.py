"""ZeRO-2/3 checkpoints name parameters as they are at save/load time, not by the objects seen at initialize.

`DeepSpeedEngine.__init__` builds `self.param_names = {param: name}` from the model once, keyed by the Parameter
*object*, and hands that same dict to its ZeRO/BF16 optimizers. Anything that puts a new Parameter object in the
model afterwards (accelerate's `set_module_tensor_to_device`, which `dispatch_model` onto several devices or with
offload uses; plain `module.weight = nn.Parameter(...)`) leaves a key that no longer is in the model and a
parameter that has no key: at ZeRO >= 2 `save_checkpoint` then raises `ValueError: failed to find frozen
Parameter containing: ... in named params` (`_get_zero_frozen_param_attributes`), and so does `load_checkpoint`
into such a model (`load_module_state_dict`); the replaced tensor stays referenced by the stale key forever
(deepspeedai/DeepSpeed issue 6620; PR 6626 open, unmerged; the thread snapshot available here shows the issue
closed, yet 0.19.8's source fails exactly so). A *trainable* parameter replaced that way is worse:
the optimizer keeps updating the old tensor, so the new one silently stops training, and a save writes the old
values under its name.

The fix: just before the three functions read `self.param_names`, it is brought up to date with
`self.module.named_parameters()` *in place* (the optimizers share the same dict object, so they see it too):
keys of frozen parameters that left the model are dropped (the replaced tensor can be freed), parameters that
have no key get their current name. `_get_zero_param_shapes` (every save at ZeRO >= 1) and
`load_module_state_dict` (every load) also check that each parameter the optimizer owns is still the model's
parameter of that name, and raise a RuntimeError naming it and saying what to do when one was replaced. When
nothing was replaced the dict is left untouched (bit-identical checkpoints). Cost: one `named_parameters()`
walk per save/load call, nothing per step.

How: each target is rebuilt from the installed source (`txn.recode`) with one statement added at the top of its
body, a call of `refresh(self, ...)` from this module (builtins only: nothing is added to deepspeed).

Upstream PR 6626 (open, unmerged) could not be read for this patch: neither its diff nor its branch is in the
reference corpus available here (only issue 6620's thread is, where the reporter proposed iterating
`self.module.named_parameters()` inside `_get_zero_frozen_param_attributes` and a maintainer answered that
DeepSpeed needs `param_names` to know every parameter). This patch goes further than that proposal, on
purpose: it keeps `param_names` itself (the dict the ZeRO/BF16 optimizers hold) current instead of bypassing
it in one function, so the optimizers' lookups (universal checkpoints) and the load path agree with the save
path and no stale key pins a replaced, possibly offloaded, tensor; it covers `load_module_state_dict` too; and
it turns the silent case (a replaced *trainable* parameter) into an error instead of saving the old tensor's
values under its name.
The upstream form is `upstream_prs/deepspeed/0004-*.patch` (a `_refresh_param_names` method called from the
same three places).
"""
import os

from dspatch.spec import BugSeen, Patch, Target

ENGINE = "deepspeed.runtime.engine"
FROZEN = "DeepSpeedEngine._get_zero_frozen_param_attributes"
SHAPES = "DeepSpeedEngine._get_zero_param_shapes"
LOAD = "DeepSpeedEngine.load_module_state_dict"

# Bands of released source (tests/test_gating_frozen_param_names.py recomputes them from every sdist)
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

    from dspatch.rewrite import RewriteError

    if not definition.args.args or definition.args.args[0].arg != "self":
        raise RewriteError(f"{definition.name}: expected a method of DeepSpeedEngine")
    reads = [node for node in ast.walk(definition) if isinstance(node, ast.Attribute) and node.attr == "param_names"
             and isinstance(node.value, ast.Name) and node.value.id == "self"]
    if not reads:
        raise RewriteError(f"{definition.name}: does not read self.param_names")
    # saving: _get_zero_param_shapes (first) checks the optimizer's parameters, _get_zero_frozen_param_attributes
    # renames the frozen ones; loading: load_module_state_dict does both
    flags = {SHAPES: "update=False", FROZEN: "check=False", LOAD: ""}[f"DeepSpeedEngine.{definition.name}"]
    call = ast.parse(f"__import__({__name__!r}).{__name__.partition('.')[2]}.refresh(self, {flags})").body[0]
    body = definition.body
    first = 1 if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                  and isinstance(body[0].value.value, str)) else 0  # after a docstring
    for sub in ast.walk(call):  # tracebacks point at the first line of upstream's body
        if "lineno" in sub._attributes:
            ast.copy_location(sub, body[first])
    body.insert(first, call)


def apply(txn):
    for target in txn.patch.targets:
        txn.recode(target, _refresh_first)


# ----------------------------------------------------------------------------------------------------
# Reproducers: real deepspeed.initialize (CPU) on a tiny model with a frozen layer, real save/load_checkpoint.

def config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=64)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": zero, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}


def model(seed=0):
    """A frozen `base` layer (as a LoRA/adapter job has) under a trainable `head`."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head(torch.relu(self.base(x))).pow(2).mean()

    torch.manual_seed(seed)
    m = Tiny()
    m.base.requires_grad_(False)
    return m


def engine_for(stage, seed=0):
    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    m = model(seed)
    engine, *_ = deepspeed.initialize(model=m, config=config(stage),
                                      model_parameters=[p for p in m.parameters() if p.requires_grad])
    return engine


def train(engine, steps=2):
    import torch

    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = engine(torch.randn(2, 8, generator=generator))
        engine.backward(loss)
        engine.step()


def snapshot(engine):
    """{name: full tensor} of every parameter (gathered at ZeRO-3)."""
    import deepspeed
    import torch

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params)):
        return {n: p.detach().clone().to(torch.float32) for n, p in engine.module.named_parameters()}


def replace_weight(engine, name, value, zero3):
    """`module.<name> = nn.Parameter(value)` as user code does; at ZeRO-3 the new Parameter is made under
    deepspeed.zero.Init (the way real code creates parameters that ZeRO-3 manages)."""
    import deepspeed
    import torch

    owner = engine.module.get_submodule(name.rpartition(".")[0])
    attr = name.rpartition(".")[2]
    frozen = not getattr(owner, attr).requires_grad
    if zero3:  # zero.Init converts the parameters of modules built under it (a bare nn.Parameter stays plain)
        with deepspeed.zero.Init(config_dict_or_path=config(3)):
            new = torch.nn.Linear(value.shape[1], value.shape[0], bias=False).weight
        new.requires_grad_(not frozen)
        with deepspeed.zero.GatheredParameters([new], modifier_rank=0):
            new.data.copy_(value)
    else:
        new = torch.nn.Parameter(value.clone(), requires_grad=not frozen)
    setattr(owner, attr, new)
    return new


def _save(engine, path, tag="t"):
    try:
        engine.save_checkpoint(path, tag=tag)
    except ValueError as e:
        if "failed to find frozen" not in str(e):
            raise
        raise BugSeen(f"save_checkpoint: ValueError: {str(e).split(' Parameter')[0]}") from e


def _loads_past_weights_only_bug():
    from dspatch.scenario import loads_past_weights_only_bug

    return loads_past_weights_only_bug()


def _load(engine, path, tag="t"):
    try:
        with _loads_past_weights_only_bug():
            engine.load_checkpoint(path, tag=tag)
    except ValueError as e:
        if "failed to find frozen" not in str(e):
            raise
        raise BugSeen(f"load_checkpoint: ValueError: {str(e).split(' Parameter')[0]}") from e


def _same(saved, loaded, what):
    import torch

    differ = [n for n in saved if not torch.equal(saved[n], loaded[n])]
    if differ or set(saved) != set(loaded):
        raise AssertionError(f"{what}: {differ or sorted(set(saved) ^ set(loaded))} differ from what was saved")


def _round_trip(stage):
    import tempfile

    import torch

    engine = engine_for(stage)
    train(engine)
    replace_weight(engine, "base.weight", torch.full((8, 8), 0.25), zero3=stage == 3)
    if stage == 2:  # at ZeRO-3 a step after a replacement trips the recorded fetch trace (another matter)
        train(engine, 1)
    saved = snapshot(engine)
    with tempfile.TemporaryDirectory() as path:
        _save(engine, path)
        fresh = engine_for(stage, seed=5)  # an unmodified model, other values everywhere
        _load(fresh, path)
        _same(saved, snapshot(fresh), f"ZeRO-{stage} load into a fresh engine")


def zero2_frozen_replaced():
    """ZeRO-2: a frozen weight replaced by a new nn.Parameter after initialize; save, then load into a fresh
    engine built from an unmodified model gives back exactly the saved tensors."""
    _round_trip(2)


def zero3_frozen_replaced():
    """ZeRO-3: the same with the replacement made under deepspeed.zero.Init."""
    _round_trip(3)


def load_after_replacement():
    """ZeRO-2: save, replace a frozen weight, load_checkpoint into the same engine: back to the saved tensors."""
    import tempfile

    import torch

    engine = engine_for(2)
    train(engine)
    saved = snapshot(engine)
    with tempfile.TemporaryDirectory() as path:
        engine.save_checkpoint(path, tag="t")
        replace_weight(engine, "base.weight", torch.zeros(8, 8), zero3=False)
        _load(engine, path)
    _same(saved, snapshot(engine), "load_checkpoint after the replacement")


def trainable_replaced_refused():
    """ZeRO-2: a trainable weight replaced after initialize no longer trains; the next save must say so."""
    import tempfile

    import torch

    engine = engine_for(2)
    train(engine)
    new = replace_weight(engine, "head.weight", torch.full((1, 8), 0.5), zero3=False)
    train(engine)
    with tempfile.TemporaryDirectory() as path:
        try:
            engine.save_checkpoint(path, tag="t")
        except RuntimeError as e:
            if str(e) != REPLACED.format(name="head.weight"):
                raise
            return
    stuck = bool(torch.all(new.detach() == 0.5))
    raise BugSeen(f"a replaced trainable weight was saved silently (its new tensor {'never' if stuck else ''} "
                  f"trained)".replace("  ", " "))


def accelerate_set_module_tensor():
    """accelerate (issue 6620's shape): prepare a model with a DeepSpeed plugin (ZeRO-2), move the frozen weights
    with accelerate's `set_module_tensor_to_device` as `dispatch_model` does, then save_state/load_state."""
    import tempfile

    import torch

    from dspatch.scenario import init_deepspeed

    init_deepspeed()  # the rendezvous variables accelerate needs to pick DeepSpeed
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, set_module_tensor_to_device

    AcceleratorState._reset_state(True)
    cfg = config(2)
    cfg.pop("optimizer")
    plugin = DeepSpeedPlugin(hf_ds_config=cfg)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    m = model()
    optimizer = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    engine, optimizer = accelerator.prepare(m, optimizer)
    if type(engine).__name__ != "DeepSpeedEngine":
        raise AssertionError(f"accelerate did not use DeepSpeed: {type(engine).__name__}")
    train(engine)
    module = engine.module
    for name, value in (("base.weight", torch.full((8, 8), 0.125)), ("base.bias", torch.full((8,), -0.5))):
        set_module_tensor_to_device(module, name, "cpu", value=value)
    train(engine, 1)
    saved = snapshot(engine)
    with tempfile.TemporaryDirectory() as path:
        try:
            accelerator.save_state(os.path.join(path, "s"))
        except ValueError as e:
            if "failed to find frozen" not in str(e):
                raise
            raise BugSeen(f"save_state: ValueError: {str(e).split(' Parameter')[0]}") from e
        with torch.no_grad():
            for p in module.parameters():
                p.data.add_(1.0)  # changed in between
        with _loads_past_weights_only_bug():
            accelerator.load_state(os.path.join(path, "s"))
    _same(saved, snapshot(engine), "accelerate load_state")
    AcceleratorState._reset_state(True)


PATCH = Patch(
    id="deepspeed/frozen-param-names",
    summary="ZeRO-2/3 save/load after a parameter object was replaced (accelerate dispatch): names looked up at use",
    distribution="deepspeed",
    affected=">=0",  # open upstream: no fixed release, the fingerprints decide
    fixed_in=None,
    targets=[Target(module, qualname, prints) for (module, qualname), prints in FINGERPRINTS.items()],
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6620",
           "https://github.com/deepspeedai/DeepSpeed/pull/6626"),
    supported=">=0.14.0",
    # one diff per band of releases whose files differ around the change (each applies as it is); the last
    # is the one to forward upstream
    diffs={">=0.14.0,<=0.19.2": "deepspeed/0004-engine-param-names-at-checkpoint-time-0.14.0-0.19.2.patch",
           ">=0.19.3,<=0.19.7": "deepspeed/0004-engine-param-names-at-checkpoint-time-0.19.3-0.19.7.patch",
           "==0.19.8": "deepspeed/0004-engine-param-names-at-checkpoint-time.patch"},
    scenarios={"zero2_frozen_replaced": zero2_frozen_replaced, "zero3_frozen_replaced": zero3_frozen_replaced,
               "load_after_replacement": load_after_replacement,
               "trainable_replaced_refused": trainable_replaced_refused,
               "accelerate_set_module_tensor": accelerate_set_module_tensor},
    expected_on_stock={"zero2_frozen_replaced": "save_checkpoint: ValueError: failed to find frozen",
                       "zero3_frozen_replaced": "save_checkpoint: ValueError: failed to find frozen",
                       "load_after_replacement": "load_checkpoint: ValueError: failed to find frozen",
                       "trainable_replaced_refused": "a replaced trainable weight was saved silently",
                       "accelerate_set_module_tensor": "save_state: ValueError: failed to find frozen"},
    signatures=(r"ValueError: failed to find frozen ",),
    note=("open upstream (issue 6620; PR 6626 unmerged): gated by the source of its targets, not by a release. "
          "Three DeepSpeedEngine checkpoint methods keep their objects, names and line numbers but run code rebuilt "
          "from the installed file with one added first statement that refreshes engine.param_names"),
)
