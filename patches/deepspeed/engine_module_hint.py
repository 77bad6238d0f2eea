"""`engine.model` on a DeepSpeed engine: the AttributeError says where the model is (`engine.module`).

`deepspeed.initialize` returns an engine that wraps the model at `engine.module`; `DeepSpeedEngine.__getattr__`
passes names it lacks through to that model. When neither has the name, every release raises
`AttributeError: 'DeepSpeedEngine' object has no attribute 'model'` and never says where the model is. So
`engine.model` (the common mistake: it works by accident on Llama/OPT, whose HF classes have a `.model` child,
and fails on GPT-2, Bloom or a reward-model wrapper) reads like a DeepSpeed bug. DeepSpeed-Chat's step 1 and
step 2 scripts make exactly this call (DeepSpeedExamples issue 924).

The fix changes only that message: it keeps the stock text as its first sentence and adds the wrapped model's
class, that it is `engine.module`, and for `model` "did you mean `engine.module`?". `PipelineEngine` and
`DeepSpeedHybridEngine` inherit `DeepSpeedEngine.__getattr__` (no release 0.14.0-0.19.8 defines another engine
pass-through), so they are covered by the same target.

How: the target is rebuilt from the installed source (`txn.recode`) with one change, the argument of its
`raise AttributeError(...)` statement(s) becomes `message(self, name, <the stock message>)` from this module.
Every lookup that succeeds runs upstream's bytecode unchanged (a wrapper would sit on every pass-through
lookup: `engine.config`, `engine.generate`, ...); the exception is the one upstream raises, at the same line,
with the same type, chaining and `name`/`obj`. `message` reads the engine's `__dict__` only (never an
attribute lookup on the engine, so a half-built or unpickling engine cannot recurse through it) and falls back
to the stock text on anything unexpected.
"""
from dspatch.spec import BugSeen, Patch, Target

ENGINE = "deepspeed.runtime.engine"
GETATTR = "DeepSpeedEngine.__getattr__"

# Bands of released source (tests/test_gating_engine_module_hint.py recomputes them from every sdist):
# 0.14.0-0.14.2 also handle a CompiledModuleWrapper (second message), 0.14.3 dropped that, and 0.19.6
# (PR 8288) rewrote the lookup as `super().__getattr__` + `getattr(module, name)`. Same final message in all.
FINGERPRINTS = {
    (ENGINE, GETATTR): {"b89bab2187e2eef1": "0.14.0-0.14.2", "5d7184bbdf74f73b": "0.14.3-0.19.5",
                        "2b4ad7b1b86e791f": "0.19.6-0.19.8"},
}


def message(engine, name, stock):
    """The stock message plus where the wrapped model is. Reads `vars(engine)` only; never raises."""
    try:
        state = vars(engine)
        model = state.get("module")
        if model is None:
            model = (state.get("_modules") or {}).get("module")
        if model is None:  # half-built or being unpickled: nothing to point at
            return stock
        kind = type(model).__name__
        inner = vars(model).get("wrapped") if kind == "CompiledModuleWrapper" else None  # 0.14.0-0.14.2
        if inner is not None:
            kind = f"{kind} around {type(inner).__name__}"
        text = f"{stock}. The model this engine wraps ({kind}) is `engine.module`"
        return text + (": did you mean `engine.module`?" if name == "model" else ".")
    except Exception:
        return stock


def _hint_raises(definition):
    """Transform: `raise AttributeError(<msg>)` -> `raise AttributeError(<this module>.message(self, name, <msg>))`
    for each such statement in the definition (one; two in 0.14.0-0.14.2)."""
    import ast

    from dspatch.rewrite import RewriteError

    self_name, name_name = (a.arg for a in definition.args.args[:2])
    sites = [node for node in ast.walk(definition) if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
             and isinstance(node.exc.func, ast.Name) and node.exc.func.id == "AttributeError"
             and len(node.exc.args) == 1 and not node.exc.keywords]
    if not sites:
        raise RewriteError(f"{definition.name}: no `raise AttributeError(...)` to add the hint to")
    for node in sites:
        stock = node.exc.args[0]
        # builtins only: nothing is added to deepspeed's module. `__import__` of an imported module is a
        # sys.modules hit that returns the top package (no fromlist: that would look for a `__path__` it lacks)
        helper = ast.parse(f"__import__({__name__!r}).{__name__.partition('.')[2]}.message({self_name}, {name_name})",
                           mode="eval").body
        for sub in ast.walk(helper):  # tracebacks point at upstream's raise line
            if "lineno" in sub._attributes:
                ast.copy_location(sub, stock)
        helper.args.append(stock)
        node.exc.args[0] = helper


def apply(txn):
    for target in txn.patch.targets:
        txn.recode(target, _hint_raises)


# ----------------------------------------------------------------------------------------------------
# Reproducers: real deepspeed.initialize (CPU, ZeRO stage 0) on tiny models built from configs.

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


PATCH = Patch(
    id="deepspeed/engine-module-hint",
    summary="AttributeError on a DeepSpeed engine (`engine.model`) says the wrapped model is `engine.module`",
    distribution="deepspeed",
    affected=">=0",  # every release: the bug is open upstream (no fixed_in), so the fingerprints decide
    fixed_in=None,
    targets=[Target(module, qualname, prints) for (module, qualname), prints in FINGERPRINTS.items()],
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeedExamples/issues/924",),
    supported=">=0.14.0",
    # one diff per band of releases whose files differ around the change (each applies as it is); the last
    # is the one to forward upstream
    diffs={">=0.14.0,<=0.14.2": "deepspeed/0003-engine-getattr-module-hint-0.14.0-0.14.2.patch",
           ">=0.14.3,<=0.17.0": "deepspeed/0003-engine-getattr-module-hint-0.14.3-0.17.0.patch",
           ">=0.17.1,<=0.19.5": "deepspeed/0003-engine-getattr-module-hint-0.17.1-0.19.5.patch",
           ">=0.19.6,<=0.19.8": "deepspeed/0003-engine-getattr-module-hint.patch"},
    scenarios={"gpt2_engine_model": gpt2_engine_model, "reward_engine_model": reward_engine_model,
               "pipeline_engine_model": pipeline_engine_model},
    expected_on_stock={"gpt2_engine_model": "AttributeError: 'DeepSpeedEngine' object has no attribute 'model' (no",
                       "reward_engine_model": "AttributeError: 'DeepSpeedEngine' object has no attribute 'model' (no",
                       "pipeline_engine_model": "AttributeError: 'PipelineEngine' object has no attribute 'model' (no"},
    # any attribute a user expected on the engine (`model` is DeepSpeed-Chat's), in the message of every release
    signatures=(r"AttributeError: '(DeepSpeed|Pipeline)Engine' object has no attribute '\w+'$",),
    note=("DeepSpeedEngine.__getattr__ keeps its object, name and line numbers but runs code rebuilt from the "
          "installed file whose AttributeError message adds where the model is; successful lookups run "
          "upstream's bytecode unchanged"),
)
