"""Reproducers: real deepspeed.zero.Init and deepspeed.initialize on the CPU. A model class shaped as transformers
4.54+'s Generic* heads: a mixin that is not an nn.Module, whose `__init__` builds the layers, before an nn.Module
base whose `__init__` builds none (PreTrainedModel's keeps the config), and no `__init__` of its own. It is built
under zero.Init after another zero.Init context has been left (the policy loaded first), then handed to
deepspeed.initialize, as GRPO's reward model is.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof


def _classes():
    """Fresh classes per call (the bug writes into a class's __dict__, which would outlive one scenario)."""
    import torch

    class Head:  # not an nn.Module: its __init__ is reached through the MRO only
        def __init__(self, width):
            super().__init__(width)
            self.body = torch.nn.Linear(width, width)
            self.score = torch.nn.Linear(width, 1)

    class Base(torch.nn.Module):
        def __init__(self, width):  # no layers: the config, as PreTrainedModel's
            super().__init__()
            self.width = width

    class Model(Head, Base):  # no __init__ of its own, as LlamaForSequenceClassification on transformers 4.54+
        pass

    return Base, Model


def reward_model_after_zero_init():
    """After a zero.Init context was left, a class that only inherits its __init__, built under zero.Init again,
    has its mixin's layers (partitioned, and whole when gathered), and deepspeed.initialize takes it for inference."""
    from dspatch.scenario import init_deepspeed, zero3_config

    deepspeed = init_deepspeed()
    base, model_class = _classes()
    config = zero3_config()
    with deepspeed.zero.Init(config_dict_or_path=config):
        base(4)  # any model loaded under ZeRO-3 (the policy): the context is left afterwards
    with deepspeed.zero.Init(config_dict_or_path=config):
        reward = model_class(4)
    names = sorted(n for n, _ in reward.named_parameters())
    try:
        engine, *_ = deepspeed.initialize(model=reward, config={k: v for k, v in config.items() if k != "optimizer"})
    except IndexError as e:
        if names:
            raise
        raise BugSeen(f"a class with no __init__ of its own, built after zero.Init was left: its mixin's __init__ "
                      f"never ran, no parameters; deepspeed.initialize: IndexError: {e}") from e
    if names != ["body.bias", "body.weight", "score.bias", "score.weight"]:
        raise AssertionError(f"built under zero.Init: parameters {names}")
    with deepspeed.zero.GatheredParameters(list(reward.parameters())):
        shapes = {n: tuple(p.shape) for n, p in reward.named_parameters()}
    if shapes != {"body.bias": (4,), "body.weight": (4, 4), "score.bias": (1,), "score.weight": (1, 4)}:
        raise AssertionError(f"built under zero.Init: shapes {shapes}")
    engine.destroy()


PROOF = Proof(
    scenarios={"reward_model_after_zero_init": reward_model_after_zero_init},
    expected_on_stock={"reward_model_after_zero_init": "a class with no __init__ of its own, built after zero.Init was "
                                                       "left: its mixin's __init__ never ran"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
)
