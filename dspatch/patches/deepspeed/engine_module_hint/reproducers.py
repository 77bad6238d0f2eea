"""Reproducers: real deepspeed.initialize (CPU, ZeRO stage 0) on tiny models built from configs.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof


def _config():
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}


def gpt2_model():
    """GPT-2 shaped (its blocks sit under `.transformer`, no `.model` child), as DeepSpeed-Chat trains it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def reward_model():
    """DeepSpeed-Chat's reward-model shape: the base model at `.rwtransformer`, a value head at `.v_head`."""
    import torch

    class RewardModel(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.config = base.config
            self.v_head = torch.nn.Linear(base.config.n_embd, 1, bias=False)
            self.rwtransformer = base.transformer

        def forward(self, input_ids):
            return self.v_head(self.rwtransformer(input_ids)[0]).squeeze(-1)

    return RewardModel(gpt2_model())


def engine_for(model):
    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    engine, *_ = deepspeed.initialize(model=model, config=_config(), model_parameters=model.parameters())
    return engine


def pipeline_engine():
    """A PipelineEngine (one stage) around a PipelineModule of two linear layers."""
    import torch

    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(layers=[torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)], num_stages=1,
                           loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=model, config=_config(), model_parameters=model.parameters())
    return engine


def expect_hint(engine, kind, name="model"):
    """`getattr(engine, name)` must raise AttributeError saying the model (`kind`) is at `engine.module`."""
    stock = f"'{type(engine).__name__}' object has no attribute '{name}'"
    try:
        getattr(engine, name)
    except AttributeError as e:
        text = str(e)
        if text == stock:  # chained: the traceback shows upstream's own AttributeError, as a user's log does
            raise BugSeen(f"AttributeError: {text} (no word of `engine.module` or {kind})") from e
    else:
        raise AssertionError(f"engine.{name} resolved: the scenario needs a model without `.{name}`")
    ask = ": did you mean `engine.module`?" if name == "model" else "."
    wanted = f"{stock}. The model this engine wraps ({kind}) is `engine.module`{ask}"
    if text != wanted:
        raise AssertionError(f"unexpected message {text!r}, wanted {wanted!r}")


def gpt2_engine_model():
    """`engine.model` on a GPT-2 engine names GPT2LMHeadModel and points at `engine.module`."""
    expect_hint(engine_for(gpt2_model()), "GPT2LMHeadModel")


def reward_engine_model():
    """`engine.model` on a DeepSpeed-Chat-style reward model names it and points at `engine.module`; other
    missing names get the pointer without the question."""
    engine = engine_for(reward_model())
    expect_hint(engine, "RewardModel")
    expect_hint(engine, "RewardModel", name="lm_head")


def pipeline_engine_model():
    """The same on a PipelineEngine (it inherits DeepSpeedEngine.__getattr__)."""
    expect_hint(pipeline_engine(), "PipelineModule")


PROOF = Proof(
    scenarios={"gpt2_engine_model": gpt2_engine_model, "reward_engine_model": reward_engine_model,
               "pipeline_engine_model": pipeline_engine_model},
    expected_on_stock={"gpt2_engine_model": "AttributeError: 'DeepSpeedEngine' object has no attribute 'model' (no",
                       "reward_engine_model": "AttributeError: 'DeepSpeedEngine' object has no attribute 'model' (no",
                       "pipeline_engine_model": "AttributeError: 'PipelineEngine' object has no attribute 'model' (no"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
)
