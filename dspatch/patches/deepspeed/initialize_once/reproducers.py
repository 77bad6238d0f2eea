"""Reproducers: real deepspeed.initialize on CPU, a tiny MLP, fp32. Every comparison of losses is between two
engines that are both not the first of the process (deepspeed <= 0.16 trains the first one slightly
differently), so `_warm_up()` builds a throw-away engine once.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof
from dspatch.patches.deepspeed.initialize_once import REFUSED


def _config(stage, optimizer=True):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage}}
    if stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=64)
    if optimizer:
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
    return config


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def make_engine(model, stage, optimizer=None, inference=False):
    """A training engine (DeepSpeed's Adam, or `optimizer`), or with `inference` one with no optimizer at all."""
    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    if inference:
        return deepspeed.initialize(model=model, config=_config(stage, optimizer=False))[0]
    if optimizer is None:
        return deepspeed.initialize(model=model, config=_config(stage), model_parameters=model.parameters())[0]
    return deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage, optimizer=False))[0]


def train(engine, steps):
    import torch

    losses = []
    for i in steps:
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


_warm: list = []


def warm_up():
    if not _warm:
        _warm.append(make_engine(make_model(), 0))


def reference(stage, optimizer=False):
    """Losses of steps 0-3 of an engine that sees no second call."""
    warm_up()
    model = make_model()
    opt = _adamw(model) if optimizer else None
    return train(make_engine(model, stage, opt), range(4))


def _adamw(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def second_call(fn):
    """('refused', message) if the guard (monkeypatch or diff) refused, ('ok', value) or ('raised', exc)."""
    try:
        return "ok", fn()
    except RuntimeError as e:
        if str(e).startswith(REFUSED):
            return "refused", str(e)
        return "raised", e
    except (KeyError, IndexError) as e:
        return "raised", e


def _first_unchanged(engine, done, want, what):
    got = done + train(engine, range(2, 4))
    if got != want:
        raise AssertionError(f"{what}: the first engine's losses changed after a refused call: {got} != {want}")


def _same_model(stage):
    want = reference(stage)
    model = make_model()
    first = make_engine(model, stage)
    done = train(first, range(2))
    outcome, value = second_call(lambda: make_engine(model, stage))
    if outcome == "refused":
        if "is already in use by a live DeepSpeedEngine" not in value or f"ZeRO stage {stage}" not in value:
            raise AssertionError(f"refusal does not name the engine and its stage: {value}")
        return _first_unchanged(first, done, want, f"ZeRO-{stage}")
    if outcome == "raised":
        raise value
    went = f"second deepspeed.initialize on the model of a live ZeRO-{stage} engine went through"
    try:
        train(first, range(2, 4))
    except AttributeError as e:
        if "has no attribute 'ipg_index'" in str(e):
            raise BugSeen(f"{went}; the first engine's next step: AttributeError: {e}") from None
        raise
    try:
        train(value, range(4, 5))
    except AssertionError as e:
        text = " ".join(str(e).split())
        if stage == 2 and "has already been reduced" in text:
            raise BugSeen(f"{went}; the second engine's first step: AssertionError: {text}") from None
        if stage == 3 and text == "":
            raise BugSeen(f"{went}; the second engine's first step: AssertionError (partitioned twice)") from None
        raise
    raise AssertionError(f"{went} and nothing failed: the scenario no longer shows the bug")


def zero2_same_model():
    """ZeRO-2, the same model given to deepspeed.initialize twice: refused, the first engine trains on unchanged."""
    _same_model(2)


def zero3_same_model():
    """ZeRO-3, the same model given to deepspeed.initialize twice: refused, the first engine trains on unchanged."""
    _same_model(3)


def zero1_same_optimizer():
    """ZeRO-1, a client optimizer already given to a live engine, given again with another model: refused, the
    first engine trains on unchanged (stock prunes the shared optimizer, then fails part-way)."""
    want = reference(1, optimizer=True)
    model = make_model()
    optimizer = _adamw(model)
    first = make_engine(model, 1, optimizer)
    done = train(first, range(2))
    outcome, value = second_call(lambda: make_engine(make_model(), 1, optimizer))
    if outcome == "refused":
        if "this optimizer (AdamW" not in value:
            raise AssertionError(f"refusal does not name the optimizer: {value}")
        return _first_unchanged(first, done, want, "ZeRO-1 optimizer")
    went = "second deepspeed.initialize with the optimizer of a live ZeRO-1 engine went through"
    if outcome == "raised" and isinstance(value, KeyError):
        got = done + train(first, range(2, 4))
        changed = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        if changed:
            raise BugSeen(f"{went} until KeyError (a parameter tensor) part-way; the first engine's losses "
                          f"changed from step {changed[0]}") from None
    if outcome == "raised":
        raise value
    raise AssertionError(f"{went} and nothing failed: the scenario no longer shows the bug")


def zero0_same_model_warns():
    """ZeRO-0, the same model twice (harmless): one warning for two such calls, both engines train, the first
    one's losses unchanged."""
    import warnings

    want = reference(0)
    model = make_model()
    first = make_engine(model, 0)
    done = train(first, range(2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        second = make_engine(model, 0)
        make_engine(model, 0)
    ours = [w for w in seen if "is already in use by a live" in str(w.message)]
    if not ours:
        raise BugSeen("second deepspeed.initialize on the model of a live ZeRO-0 engine went through without a word")
    if len(ours) != 1 or "live DeepSpeedEngine" not in str(ours[0].message) or "stage 0" not in str(ours[0].message):
        raise AssertionError(f"wanted one warning naming the engine, got {[str(w.message) for w in ours]}")
    _first_unchanged(first, done, want, "ZeRO-0")
    train(second, range(4, 5))


def allowed_calls():
    """Several different models (ZeRO-3, ZeRO-2), and a model initialized again after its engine's destroy()
    (ZeRO-2): no error, no warning, the engines train."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a, b = make_model(), make_model()
        train(make_engine(a, 3), range(1))
        train(make_engine(b, 3), range(1))
        # after destroy(), at ZeRO-2: stock 0.16.x cannot re-initialize a destroyed ZeRO-3 model at all (its
        # prefetch trace fails, `pop from an empty deque`, patched or not), so that is not a call to allow
        model = make_model()
        first = make_engine(model, 2)
        train(first, range(1))
        first.destroy()
        train(make_engine(model, 2), range(1, 3))
    ours = [str(w.message) for w in seen if "is already in use by a live" in str(w.message)]
    if ours:
        raise AssertionError(f"warned on an allowed call: {ours}")


def _inference_forward(engine):
    """What an inference engine does (trl's reference pass, the Trainer's evaluate): one forward, no gradients."""
    import torch

    engine.eval()
    with torch.no_grad():
        return engine(torch.linspace(-1, 1, 16).reshape(2, 8))


def inference_then_training():
    """An inference engine (no optimizer) on the model runs two forwards, then a training engine is built on the same
    model, as trl's precomputed reference and the Trainer's evaluate-before-train do: ZeRO-3 -> ZeRO-3 and ZeRO-0 ->
    ZeRO-2 go through as on stock and train exactly as with no inference engine before (losses bit-identical)."""
    for first_stage, stage in ((3, 3), (0, 2)):
        want = reference(stage)
        model = make_model()
        inference = make_engine(model, first_stage, inference=True)
        _inference_forward(inference)
        _inference_forward(inference)  # one forward only: stock's ZeRO-3 trace fails the next engine from 0.15.4
        outcome, engine = second_call(lambda: make_engine(model, stage))
        if outcome == "refused":
            raise BugSeen(f"refused a training engine after a ZeRO-{first_stage} inference engine, which trains on "
                          f"stock: {engine}")
        if outcome == "raised":
            raise engine
        engine.train()
        got = train(engine, range(4))
        if got != want:
            raise AssertionError(f"ZeRO-{first_stage} inference then ZeRO-{stage} training: losses {got} != {want}")


PROOF = Proof(
    scenarios={"zero2_same_model": zero2_same_model, "zero3_same_model": zero3_same_model,
               "zero1_same_optimizer": zero1_same_optimizer, "zero0_same_model_warns": zero0_same_model_warns,
               "allowed_calls": allowed_calls, "inference_then_training": inference_then_training},
    expected_on_stock={
      "zero2_same_model": "second deepspeed.initialize on the model of a live ZeRO-2 engine went through",
      "zero3_same_model": "second deepspeed.initialize on the model of a live ZeRO-3 engine went through",
      "zero1_same_optimizer": "second deepspeed.initialize with the optimizer of a live ZeRO-1 engine went through",
      "zero0_same_model_warns": "ZeRO-0 engine went through without a word",
  },
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    # The bug writes nothing a log would show: why `python -m dspatch.explain` cannot name it.
    silent="a second initialize goes through without a word; what breaks later varies",
)
