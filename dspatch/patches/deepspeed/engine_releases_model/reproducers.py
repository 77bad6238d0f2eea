"""Reproducers: real deepspeed.initialize (CPU) at ZeRO stages 0 and 2, a model trained one step, then every
reference of the caller's dropped without engine.destroy() and the garbage collected: is the model freed?
(ZeRO-3 is left out: there `FWD_MODULE_STACK` keeps every model on every release, fixed or not; see the patch.)

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

MODEL_MB = 8  # each model's parameters, so that what stays alive is plain in bytes


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}


def _model():
    import torch

    width = int((MODEL_MB * 2**20 / 4 / 2) ** 0.5)  # two square layers of MODEL_MB in all
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


def _build_train_drop(stage, names=None):
    """Build an engine around a fresh model, train one step, drop it all; a weak reference to the model. With
    `names`, record what DeepSpeed's debug messages call the model's first parameter while it lives."""
    import gc
    import weakref

    import torch

    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    model = _model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=_config(stage),
                                                   model_parameters=model.parameters())
    loss = engine(torch.randn(2, model[0].in_features)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    if names is not None:
        from deepspeed.utils.debug import debug_module2name, debug_param2name

        names.append((debug_module2name(model[0]), debug_param2name(model[2].weight)))
    ref = weakref.ref(model)
    del model, engine, optimizer, loss
    gc.collect()
    return ref


def _dropped_engine_frees_its_model(stage):
    names = []
    ref = _build_train_drop(stage, names)
    if names != [("0", "2.weight")]:  # the debug names still work while the model lives
        raise AssertionError(f"DeepSpeed's debug names of the model's modules and parameters: {names}")
    if ref() is not None:
        raise BugSeen(f"ZeRO-{stage}: the model of an engine dropped without destroy() is still alive after "
                      f"gc.collect() (held by deepspeed.utils.debug's name maps)")


def zero0_dropped_engine():
    """ZeRO stage 0: the model of an engine dropped without destroy() is freed by gc.collect(), and DeepSpeed's
    debug messages still name its modules and parameters while it lives."""
    _dropped_engine_frees_its_model(0)


def zero2_dropped_engine():
    """The same at ZeRO-2."""
    _dropped_engine_frees_its_model(2)


def ten_engines_in_a_loop():
    """A sweep: ten engines (8 MB of parameters each) built, trained and dropped in a loop, then everything
    collected: no model, and none of their parameters' bytes, is left alive."""
    refs = [_build_train_drop(0) for _ in range(10)]
    import gc

    gc.collect()
    alive = [r() for r in refs if r() is not None]
    held = sum(p.numel() * p.element_size() for m in alive for p in m.parameters()) / 2**20
    if alive:
        raise BugSeen(f"after ten engines built and dropped in a loop, {len(alive)} model(s) still alive "
                      f"({held:.0f} MB of parameters)")


PROOF = Proof(
    scenarios={"zero0_dropped_engine": zero0_dropped_engine, "zero2_dropped_engine": zero2_dropped_engine,
               "ten_engines_in_a_loop": ten_engines_in_a_loop},
    expected_on_stock={
      "zero0_dropped_engine": "ZeRO-0: the model of an engine dropped without destroy() is still alive",
      "zero2_dropped_engine": "ZeRO-2: the model of an engine dropped without destroy() is still alive",
      "ten_engines_in_a_loop": f"after ten engines built and dropped in a loop, 1 model(s) still alive ({MODEL_MB} MB",
  },
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    # The bug writes nothing a log would show: why `python -m dspatch.explain` cannot name it.
    silent="memory held, no message: proven by what gc.collect() frees",
)
