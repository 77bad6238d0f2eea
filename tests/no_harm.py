"""The no-harm matrix: every recipe of tests/recipes.py at ZeRO-2 and ZeRO-3, stock and with DSPATCH=1, on the stack of
the session (tests/test_no_harm_*.py split it in two, so that pytest-xdist's two workers share it).

The rule, per cell:
- stock trains: DSPATCH=1 trains, with the same losses and bit-identical weights, unless CHANGES names the patch
  that changes them there (a bug that stock hits silently);
- stock fails: the cell must be declared in STOCK_FAILS, with what DSPATCH=1 does there (a patch fixes it: then it
  trains; or no patch does: it fails the same way). A failure only DSPATCH=1 has fails the test, whatever patch
  causes it; so does a stock failure nobody declared.
Both runs of a cell come from warm interpreters (tests/warm.py): the stock one with no DSPATCH at start, the other
with DSPATCH=1 at start, as a user's ranks have it.
"""
import json
import os

from packaging.version import Version

from conftest import ROOT, clean_env, run_python

STAGES = (2, 3)
TRAINER = ("trainer", "trainer_eval_predict", "trainer_evaluate_first", "trainer_twice", "trainer_resume",
           "accelerate_loop")
TRL = ("sft", "dpo_ref_model", "dpo", "dpo_lora", "dpo_precompute_1", "dpo_precompute_2", "dpo_lora_precompute",
       "kto", "kto_precompute", "grpo_reward_function", "grpo_reward_model", "reward")


def installed(name):
    from dspatch.gating import installed_version

    found = installed_version(name)
    return Version(found) if found else None


def _between(name, low=None, high=None):
    """Whether the installed `name` is >= low and < high."""
    v = installed(name)
    return v is not None and (low is None or v >= Version(low)) and (high is None or v < Version(high))


BY_DESIGN = "fails too: refused by trl on purpose at ZeRO-3"
PRECOMPUTE_REFUSED = "You cannot use `precompute_ref_log_probs=True` with Deepspeed ZeRO-3"
WEIGHTS_ONLY = "fixed by deepspeed/checkpoint-weights-only"
ZIP = "zip() argument 2 is longer than argument 1"
SCHEDULER = "fixed by transformers/trainer-scheduler-after-deepspeed"
# (recipe, stage) -> [(condition on the installed versions, stock's failure (a fragment, or a tuple of them: one must
# be in it), what DSPATCH=1 does:
# "fixed by <patch id>" or "fails too: <why no patch fixes it>")]
STOCK_FAILS = {
    ("trainer_evaluate_first", 2): [(lambda: True, "ZeRO inference only makes sense with ZeRO Stage 3",
                                     "fails too: refused by transformers on purpose (evaluation needs ZeRO-3)")],
    ("trainer_evaluate_first", 3): [(lambda: True, ("total_num_steps=0", "'NoneType' object has no attribute 'backward'"),
                                     "fixed by transformers/trainer-stale-deepspeed-engine")],
    ("trainer_twice", 2): [(lambda: True, "'NoneType' object has no attribute 'backward'",
                            "fixed by transformers/trainer-stale-deepspeed-engine")],
    ("trainer_twice", 3): [(lambda: True, "'NoneType' object has no attribute 'backward'",
                            "fixed by transformers/trainer-stale-deepspeed-engine")],
    ("trainer_resume", 2): [(lambda: _between("transformers", high="4.47.0"), "Weights only load failed",
                             "fixed by transformers/resume-rng-weights-only")],
    ("trainer_resume", 3): [(lambda: _between("transformers", high="4.47.0"), "Weights only load failed",
                             "fixed by transformers/resume-rng-weights-only")],
    # a LoRA model's bias/norm group is empty: the scheduler built before DeepSpeed prunes it fails at its first step
    ("dpo_lora", 2): [(lambda: _between("transformers", high="5.1.0"), ZIP, SCHEDULER)],
    ("dpo_lora", 3): [(lambda: _between("transformers", high="5.1.0"), ZIP, SCHEDULER)],
    ("dpo_lora_precompute", 2): [(lambda: _between("transformers", high="5.1.0"), ZIP, SCHEDULER)],
    # deepspeed 0.15.1-0.17.5 undoes zero.Init's patching of a class that only inherits __init__ (transformers 4.54+
    # GenericForSequenceClassification heads): the reward model, loaded after the policy under zero.Init, is empty
    ("grpo_reward_model", 3): [(lambda: _between("deepspeed", "0.15.1", "0.17.6") and _between("transformers", "4.54.0"),
                                "IndexError: list index out of range", "fixed by deepspeed/zero-init-inherited-init")],
    # trl before 1.0 refuses by design what later releases do (no ref_model at ZeRO-3, a precomputed reference)
    ("dpo", 3): [(lambda: _between("trl", high="1.0.0"), "not compatible with `create_reference_model()`", BY_DESIGN)],
    ("kto", 3): [(lambda: _between("trl", high="1.0.0"), "not compatible with `create_reference_model()`", BY_DESIGN)],
    # load_state: DeepSpeed <= 0.15.4 cannot load its own checkpoint on torch >= 2.6
    ("accelerate_loop", 2): [(lambda: _between("deepspeed", high="0.16.0"), "Weights only load failed", WEIGHTS_ONLY)],
    ("accelerate_loop", 3): [(lambda: _between("deepspeed", high="0.16.0"), "Weights only load failed", WEIGHTS_ONLY)],
    ("dpo_precompute_1", 3): [(lambda: _between("trl", high="1.9.0"), PRECOMPUTE_REFUSED, BY_DESIGN),
                         (lambda: _between("trl", "1.9.0"), "pop from an empty deque",
                               "fixed by trl/precompute-ref-zero3-engine")],
    ("dpo_lora_precompute", 3): [(lambda: _between("trl", high="1.9.0"), PRECOMPUTE_REFUSED, BY_DESIGN),
                         (lambda: _between("trl", "1.9.0"), "pop from an empty deque",
                                  "fixed by trl/precompute-ref-zero3-engine")],
    ("dpo_precompute_2", 3): [(lambda: _between("trl", high="1.9.0"), PRECOMPUTE_REFUSED, BY_DESIGN)],
    ("kto_precompute", 3): [(lambda: _between("trl", high="1.9.0"), PRECOMPUTE_REFUSED, BY_DESIGN)],
}
# (recipe, stage) -> [(condition, the patch whose fix changes the numbers of a run stock completes)]
CHANGES = {}


def cell(recipe, stage, patched):
    env = clean_env(DSPATCH="1") if patched else clean_env()
    proc = run_python([os.path.join(ROOT, "tests", "recipes.py"), recipe, str(stage)], env=env, warm="stack",
                      check=False, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("R ")]
    assert lines, f"{recipe} at ZeRO-{stage} printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    found = json.loads(lines[-1][2:])
    found["log"] = proc.stderr[-3000:]
    return found


def check(recipe, stage):
    import pytest

    stock = cell(recipe, stage, patched=False)
    if stock["status"] == "unavailable":
        pytest.skip(stock["why"])
    patched = cell(recipe, stage, patched=True)
    declared = [(fragment, outcome) for condition, fragment, outcome in STOCK_FAILS.get((recipe, stage), ())
                if condition()]
    if stock["status"] == "ok":
        assert not declared, f"declared to fail on stock, but stock trains: {declared}"
        assert patched["status"] == "ok", f"DSPATCH=1 fails where stock trains: {patched['status']}\n{patched['log']}"
        changed = [pid for condition, pid in CHANGES.get((recipe, stage), ()) if condition()]
        same = (patched["losses"], patched["weights"], patched["extra"]) == \
            (stock["losses"], stock["weights"], stock["extra"])
        assert same or changed, f"DSPATCH=1 changed the numbers: {patched} != {stock}"
        return
    assert declared, f"stock fails, undeclared: {stock['status']}\n{stock['log']}"
    fragment, outcome = declared[0]
    fragments = (fragment,) if isinstance(fragment, str) else fragment
    assert any(f in stock["status"] for f in fragments), \
        f"stock fails otherwise than declared ({fragment!r}): {stock['status']}"
    if outcome.startswith("fixed by"):
        assert patched["status"] == "ok", f"{outcome}, but DSPATCH=1: {patched['status']}\n{patched['log']}"
    else:  # no patch fixes it: DSPATCH=1 fails the same way (an earlier stock failure may be fixed on the way)
        assert any(f in patched["status"] for f in fragments), \
            f"stock: {stock['status']}; DSPATCH=1: {patched['status']}"
