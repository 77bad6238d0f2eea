"""Reproducers: a PPO-shaped model at ZeRO-3 (the trained root holds the policy, a tiny Llama, and a value head),
real deepspeed.initialize on the CPU; generation runs the policy alone with ZeRO-3's hooks removed and registered
again, as the callers of this bug do; then training goes on. Each compares the losses and weights with the same
training without the generation (engines that are not the first of their process: deepspeed <= 0.16 trains the
first one slightly differently).

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import contextlib

from dspatch.patches.deepspeed.zero3_trace_invalidation import DEQUE
from dspatch.scenario import on_accelerator
from dspatch.spec import BugSeen, Proof

STEPS = 4
GENERATE_AFTER = (0, 2)


def root_with_policy():
    """The shape trl's PPO trains (PolicyAndValueWrapper): `policy` (a causal LM) and a value head under one root;
    generation calls `root.policy` only, never the root's forward."""
    import torch

    from dspatch.scenario import tiny_llama

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = tiny_llama(pad_token_id=0)
            self.value_head = torch.nn.Linear(32, 1)
            self.is_gradient_checkpointing = False  # trl's wrapper has it (trl 1.x's unwrap asks)

        def forward(self, input_ids):
            out = self.policy(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
            return out.loss + 0.1 * self.value_head(out.hidden_states[-1]).pow(2).mean()

    return Root()


def _config():
    from dspatch.scenario import zero3_config

    return zero3_config(stage3_prefetch_bucket_size=0)  # prefetching plays no part in this bug


def _batch(step):
    import torch

    return on_accelerator(torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(100 + step)))


def _train_step(engine, step):
    loss = engine(_batch(step))
    engine.backward(loss)
    engine.step()
    return loss.item()


def _weights(engine):
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


@contextlib.contextmanager
def deepspeeds_unwrap(engine):
    """deepspeed's own `unwrap_model_for_generation` (0.15.0-0.16.3): weights gathered, ZeRO-3's module hooks
    removed, and the root registered again afterwards. Releases without it (0.16.4 on) get the same steps through
    the same methods of theirs, as trl's add_hooks and the copies of it in other projects do."""
    import importlib

    import deepspeed

    own = getattr(importlib.import_module("deepspeed.runtime.zero.stage3"), "unwrap_model_for_generation", None)
    if own is not None:
        with own(engine) as model:
            yield model
        return
    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        yield engine
    offload._register_deepspeed_module(offload.module)


def _generate(engine, unwrap):
    import torch

    prompt = on_accelerator(torch.tensor([[1, 5, 9, 13], [1, 7, 11, 17]]))
    with unwrap(engine) as unwrapped, torch.no_grad():
        model = getattr(unwrapped, "module", unwrapped)
        return model.policy.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                     do_sample=False, pad_token_id=0)


def _initialize(model):
    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    return deepspeed.initialize(model=model, config=_config(), model_parameters=model.parameters())[0]


def train(generate_with=None, prepare=_initialize):
    """(losses, final weights) of STEPS training steps of a fresh engine (`prepare(model)`), generating after the
    steps in GENERATE_AFTER with `generate_with(engine)` (an unwrap context) unless it is None."""
    engine = prepare(root_with_policy())
    losses = []
    for step in range(STEPS):
        try:
            losses.append(_train_step(engine, step))
        except IndexError as e:
            if DEQUE not in str(e):  # only the bug's own failure counts as the bug
                raise
            raise BugSeen(f"training step {step} after generation: IndexError: {e}") from e
        if generate_with is not None and step in GENERATE_AFTER:
            _generate(engine, generate_with)
    return losses, _weights(engine)


_warm: list = []


def _warm_up():
    if not _warm:
        _warm.append(train())


def _same_as_without_generation(generate_with, prepare=_initialize):
    import torch

    _warm_up()
    plain_losses, plain_weights = train(None, prepare)
    losses, weights = train(generate_with, prepare)
    if losses != plain_losses:
        raise AssertionError(f"losses with generation {losses} differ from those without {plain_losses}")
    changed = [n for n in weights if not torch.equal(weights[n], plain_weights[n])]
    if changed:
        raise AssertionError(f"weights after training with generation differ from those without: {changed}")


def generation_through_deepspeeds_unwrap():
    """Train, generate with the policy inside deepspeed's unwrap_model_for_generation (or, from 0.16.4, its hook
    removal and re-registration), train on: the same losses and weights as without generating."""
    _same_as_without_generation(deepspeeds_unwrap)


@contextlib.contextmanager
def _past_the_trl_hooks_bug():
    """Where trl still calls deepspeed's old method name (trl < 0.16 with deepspeed >= 0.16.4), its
    unwrap_model_for_generation fails on that other bug first: its fix (trl/zero3-generation-hooks) is applied
    for the time of the scenario, so that it shows this bug and nothing else, then taken back."""
    import importlib

    import dspatch
    from dspatch import gating, registry
    from dspatch.scenario import applied

    hooks = registry.all_patches()["trl/zero3-generation-hooks"]
    if applied(hooks.id) or gating.evaluate(hooks).verdict != gating.APPLIES:
        yield
        return
    importlib.import_module("trl.models.utils")  # imported first, so that the fix applies now

    outcome = dspatch.apply([hooks.id])[hooks.id]
    if outcome[0] != gating.APPLIED:
        raise AssertionError(f"cannot get past trl/zero3-generation-hooks: {outcome}")
    try:
        yield
    finally:
        dspatch.revert([hooks.id], force=True)


def generation_through_trls_unwrap():
    """The same through trl's unwrap_model_for_generation on an accelerate-prepared engine, as its trainers do
    (trl >= 1.5 invalidates the trace itself: there this passes on stock too)."""
    from dspatch.scenario import init_deepspeed

    init_deepspeed()
    from trl.models.utils import unwrap_model_for_generation

    accelerators = {}

    def prepare(model):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, DummyOptim

        from dspatch.scenario import reset_accelerate

        reset_accelerate()
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config()))
        engine, _ = accelerator.prepare(model, DummyOptim(model.parameters()))
        accelerators[id(engine)] = accelerator
        return engine

    with _past_the_trl_hooks_bug():
        _same_as_without_generation(lambda engine: unwrap_model_for_generation(engine, accelerators[id(engine)]),
                                    prepare)


PROOF = Proof(
    scenarios={"generation_through_deepspeeds_unwrap": generation_through_deepspeeds_unwrap,
               "generation_through_trls_unwrap": generation_through_trls_unwrap},
    expected_on_stock={"generation_through_deepspeeds_unwrap": f"after generation: IndexError: {DEQUE}"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
)
