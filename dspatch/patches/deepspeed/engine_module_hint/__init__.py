"""`engine.model` on a DeepSpeed engine: the `AttributeError` says where the model is (`engine.module`).

`deepspeed.initialize` returns an engine that wraps the model at `engine.module`; `DeepSpeedEngine.__getattr__` passes
names it lacks through to that model. When neither has the name, every release (0.14.0-0.19.8 checked) raises
`AttributeError: 'DeepSpeedEngine' object has no attribute 'model'` and never says where the model is. So `engine.model`
(the common mistake: it works by accident on Llama/OPT, whose HF classes have a `.model` child, and fails on GPT-2,
Bloom or a reward-model wrapper) reads like a DeepSpeed bug. DeepSpeed-Chat's step 1 and step 2 scripts make exactly
this call (DeepSpeedExamples issue 924); `upstream_prs/DeepSpeedExamples/0001-*.patch` fixes them, made against
DeepSpeedExamples 45b4b71 and checked there with `git apply --check` when it was written (CI does not fetch that
repository).

The fix changes only that message: it keeps the stock text as its first sentence and adds the wrapped model's class,
that it is `engine.module`, and for `model` "did you mean `engine.module`?". `PipelineEngine` and
`DeepSpeedHybridEngine` inherit `DeepSpeedEngine.__getattr__` (no release 0.14.0-0.19.8 defines another engine
pass-through), so they are covered by the same target. Open upstream, so the fingerprint of every release gates it.

How: the target is rebuilt from the installed source (`txn.recode`) with one change, the argument of its `raise
AttributeError(...)` statement(s) becomes `message(self, name, <the stock message>)` from this module. Every lookup that
succeeds runs upstream's bytecode unchanged (a wrapper would sit on every pass-through lookup: `engine.config`,
`engine.generate`, ...; measured x0.999 on the old stack and x1.008 on latest, `bench/engine_getattr.py`); the exception
is the one upstream raises, at the same line, with the same type, chaining and `name`/`obj`. `message` reads the
engine's `__dict__` only (never an attribute lookup on the engine, so a half-built or unpickling engine cannot recurse
through it) and falls back to the stock text on anything unexpected.
"""
from dspatch.spec import Patch, Signature

ENGINE = "deepspeed.runtime.engine"
GETATTR = "DeepSpeedEngine.__getattr__"
ENGINE_METHODS = ("set_batch_fn|train_batch|eval_batch|set_dataloader|set_dataiterator|is_first_stage|is_last_stage|"
                  "no_sync")

# Bands of released source (tests/test_releases.py recomputes them from every sdist):
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
    from dspatch.rewrite import RewriteError, call_into, expression, find_all

    self_name, name_name = (a.arg for a in definition.args.args[:2])
    sites = find_all(definition, "raise AttributeError(_)")
    if not sites:
        raise RewriteError(f"{definition.name}: no `raise AttributeError(...)` to add the hint to")
    for node in sites:
        stock = node.exc.args[0]
        helper = expression(f"{call_into(__name__, 'message')}({self_name}, {name_name})", stock)
        helper.args.append(stock)
        node.exc.args[0] = helper


def apply(txn):
    for target in txn.patch.targets:
        txn.recode(target, _hint_raises)


PATCH = Patch(
    id="deepspeed/engine-module-hint",
    summary="AttributeError on a DeepSpeed engine (`engine.model`) says the wrapped model is `engine.module`",
    cause="A DeepSpeed engine keeps the model as `engine.module`; `engine.model` fails without saying so",
    symptom="`AttributeError: 'DeepSpeedEngine' object has no attribute 'model'`, no hint where it is",
    distribution="deepspeed",
    affected=">=0",  # every release: the bug is open upstream (no fixed_in), so the fingerprints decide
    fixed_in=None,
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeedExamples/issues/924",),
    supported=">=0.14.0",
    # one diff per band of releases whose files differ around the change (each applies as it is); the last
    # is the one to forward upstream
    diffs=("deepspeed/0003-engine-getattr-module-hint-0.14.0-0.14.2.patch",
           "deepspeed/0003-engine-getattr-module-hint-0.14.3-0.17.0.patch",
           "deepspeed/0003-engine-getattr-module-hint-0.17.1-0.19.5.patch",
           "deepspeed/0003-engine-getattr-module-hint-0.19.6-0.19.8.patch"),
    # any attribute a user expected on the engine (`model` is DeepSpeed-Chat's), in the message of every release;
    # generic: an attribute another patch's bug reads on the engine is that bug's
    # (DeepSpeedLight: the engine's name before 0.3); not the engine methods of PipelineEngine or DDP, whose
    # absence says nothing about where the model is
    signatures=(Signature(r"'(?:(?:DeepSpeed|Pipeline)Engine|DeepSpeedLight)' object has no attribute '(?!(?:"
                          + ENGINE_METHODS + r")')\w+'", error="AttributeError", generic=True),),
    note=("DeepSpeedEngine.__getattr__ keeps its object, name and line numbers but runs code rebuilt from the "
          "installed file whose AttributeError message adds where the model is; successful lookups run "
          "upstream's bytecode unchanged"),
)
