"""Reproducers: real deepspeed.initialize (CPU) on a tiny model with a frozen layer, real save/load_checkpoint.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import os

from dspatch.scenario import on_accelerator
from dspatch.spec import BugSeen, Proof
from dspatch.patches.deepspeed.frozen_param_names import REPLACED


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
        loss = engine(on_accelerator(torch.randn(2, 8, generator=generator)))
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
        new = torch.nn.Parameter(on_accelerator(value.clone()), requires_grad=not frozen)
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
    from dspatch.scenario import reset_accelerate
    from accelerate.utils import DeepSpeedPlugin, set_module_tensor_to_device

    reset_accelerate()
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
        set_module_tensor_to_device(module, name, on_accelerator(value).device, value=value)
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
    reset_accelerate()


PROOF = Proof(
    scenarios={"zero2_frozen_replaced": zero2_frozen_replaced, "zero3_frozen_replaced": zero3_frozen_replaced,
               "load_after_replacement": load_after_replacement,
               "trainable_replaced_refused": trainable_replaced_refused,
               "accelerate_set_module_tensor": accelerate_set_module_tensor},
    expected_on_stock={"zero2_frozen_replaced": "save_checkpoint: ValueError: failed to find frozen",
                       "zero3_frozen_replaced": "save_checkpoint: ValueError: failed to find frozen",
                       "load_after_replacement": "load_checkpoint: ValueError: failed to find frozen",
                       "trainable_replaced_refused": "a replaced trainable weight was saved silently",
                       "accelerate_set_module_tensor": "save_state: ValueError: failed to find frozen"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
)
