"""Reproducers: real deepspeed.initialize with bf16 at ZeRO stage 0 (CPU, one process) on a tiny Llama with torch's
AdamW: three steps, `save_checkpoint`, a new engine, `load_checkpoint`. The optimizer's state the new engine holds
must be the saved engine's: Adam's step count and moments, tensor for tensor. A silent bug on 0.18.0-0.18.4, proven by
numbers; on 0.17.6 the load fails (AttributeError), and the reproducer prints upstream's traceback.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS = 3


def _engine(optimizer_from_config):
    import torch

    from dspatch.scenario import init_deepspeed, tiny_llama

    deepspeed = init_deepspeed()
    model = tiny_llama()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True}
    if optimizer_from_config:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          config=config)
    if type(engine.optimizer).__name__ not in ("FP16_UnfusedOptimizer", "FP16_Optimizer"):  # the run is the one meant
        raise AssertionError(f"bf16 at stage 0 built a {type(engine.optimizer).__name__}, not the fp16 wrapper")
    return engine


def _adam_state(engine):
    """{(group, index): (step, exp_avg, exp_avg_sq)} of the torch optimizer inside the engine's wrapper, on the CPU."""
    inner = engine.optimizer.optimizer
    found = {}
    for g, group in enumerate(inner.param_groups):
        for i, param in enumerate(group["params"]):
            state = inner.state.get(param, {})
            found[g, i] = tuple(state[key].detach().float().cpu().clone() if hasattr(state[key], "detach")
                                else float(state[key]) for key in ("step", "exp_avg", "exp_avg_sq") if key in state)
    return found


def _batches(count):
    from dspatch.scenario import lm_batches, on_accelerator

    return [{key: on_accelerator(value) for key, value in batch.items()} for batch in lm_batches(count)]


def _train(engine, batches):
    from dspatch.scenario import lm_loss

    for batch in batches:
        engine.backward(lm_loss(engine, batch))
        engine.step()


def _saved_and_loaded(saved, optimizer_from_config):
    """A new engine that loaded what `saved` wrote with save_checkpoint (in a folder removed afterwards)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="dspatch-zero0-bf16-checkpoint-")
    try:
        saved.save_checkpoint(folder, tag="resume")
        resumed = _engine(optimizer_from_config)
        resumed.load_checkpoint(folder, tag="resume")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return resumed


def _resumed(optimizer_from_config):
    saved = _engine(optimizer_from_config)
    _train(saved, _batches(STEPS))
    try:
        resumed = _saved_and_loaded(saved, optimizer_from_config)
    except AttributeError as error:  # 0.17.6: the load goes for a ZeRO file the fp16 wrapper cannot name
        if "dp_process_group" not in str(error):
            raise
        import traceback

        traceback.print_exc()  # upstream's traceback, as the job's log shows it
        raise BugSeen(f"load_checkpoint did not restore Adam: it failed: {type(error).__name__}: {error}") from None
    want, got = _adam_state(saved), _adam_state(resumed)
    steps = lambda state: sorted({float(s[0]) for s in state.values() if s})
    if not all(want[key] and len(want[key]) == 3 for key in want):
        raise AssertionError(f"the saved engine's Adam has no step and moments for every parameter: {steps(want)}")
    if steps(got) != steps(want):
        raise BugSeen(f"load_checkpoint did not restore Adam: it restarted it: step {steps(got)} where the saved "
                      f"engine's read {steps(want)}")
    off = max(float((a - b).abs().max()) for key in want for a, b in zip(want[key][1:], got[key][1:]))
    if off != 0.0:
        raise BugSeen(f"load_checkpoint did not restore Adam: its moments are {off:.2e} off the saved engine's")


def client_adamw_resumed():
    """The client's torch AdamW: its state after the resume is the saved engine's."""
    _resumed(optimizer_from_config=False)


def config_adamw_resumed():
    """AdamW from the config (torch_adam): the same."""
    _resumed(optimizer_from_config=True)


PROOF = Proof(
    scenarios={"client_adamw_resumed": client_adamw_resumed, "config_adamw_resumed": config_adamw_resumed},
    expected_on_stock={"client_adamw_resumed": "load_checkpoint did not restore Adam",
                       "config_adamw_resumed": "load_checkpoint did not restore Adam"},
    silent="the resumed run trains without an error, its optimizer state new",
    loud_on="<0.18.0",  # 0.17.6: load_checkpoint's AttributeError, which the patch's signature names
    releases_checked=("0.17.6", "0.18.4"),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183", "ds0182", "ds0176"),
)


def resumed_against_uninterrupted(optimizer_from_config=False):
    """The largest difference between the weights of a run of STEPS + 1 steps and those of the same run saved after
    STEPS steps and resumed in a new engine for the last one (0.0 when the resume restores everything)."""
    from dspatch.scenario import weights, worst

    batches = _batches(STEPS + 1)
    whole = _engine(optimizer_from_config)
    _train(whole, batches)
    first = _engine(optimizer_from_config)
    _train(first, batches[:STEPS])
    resumed = _saved_and_loaded(first, optimizer_from_config)
    _train(resumed, batches[STEPS:])
    return worst(weights(resumed.module), weights(whole.module))
