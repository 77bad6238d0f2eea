"""deepspeed/frozen-param-names against the real deepspeed (and accelerate) of this stack (nox sessions old, mid,
latest).

Stock reproduces every failure exactly (save/load "failed to find frozen" at ZeRO-2 and ZeRO-3, accelerate's
save_state after set_module_tensor_to_device, a replaced trainable weight saved silently); the patch makes the
round trips exact (a fresh engine from an unmodified model gets back exactly the saved tensors) and refuses the
trainable case with its message; the upstream diff applied to a copy of the installed deepspeed does the same
with no monkeypatch; and a job that replaces nothing stays stock (same checkpoint contents, the shared
`param_names` dict untouched). Leaving out each target and drifting each target are proven by test_proofs.py.

On the old stack (deepspeed 0.14.4, torch >= 2.6) every checkpoint load first fails for another bug (torch.load's
weights_only default, dspatch's deepspeed/checkpoint-weights-only): the reproducers pass it with torch's own
escape hatch unless that patch is applied, and the patched run here applies both patches, as a user would.
"""
import json

import pytest

from dspatch import gating, registry

from conftest import clean_env, deepspeed_version, run_python, STACK, verify
from upstream_releases import changed_lines
from upstream_releases import diff_text

pytestmark = pytest.mark.stack

PID = "deepspeed/frozen-param-names"
WEIGHTS_ONLY = "deepspeed/checkpoint-weights-only"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}
STOCK = {  # exactly what stock upstream does, as the reproducers report it
    "zero2_frozen_replaced": "bug: save_checkpoint: ValueError: failed to find frozen",
    "zero3_frozen_replaced": "bug: save_checkpoint: ValueError: failed to find frozen",
    "load_after_replacement": "bug: load_checkpoint: ValueError: failed to find frozen",
    "trainable_replaced_refused": "bug: a replaced trainable weight was saved silently (its new tensor never trained)",
    "accelerate_set_module_tensor": "bug: save_state: ValueError: failed to find frozen",
}


def _with_weights_only_patch():
    """The patches a user of this stack runs: on a release with the weights_only load bug, that fix too."""
    other = registry.all_patches().get(WEIGHTS_ONLY)
    return other is not None and gating.evaluate(other).verdict == gating.APPLIES


def test_this_stack_is_covered():
    assert gating.evaluate(PATCH).verdict == gating.APPLIES
    assert STACK != "old" or _with_weights_only_patch(), "old stack: the weights_only patch should apply too"


def test_stock_upstream_reproduces_exactly():
    outcome = verify(PID, clean_env())
    assert outcome["applied"] == [] and outcome["results"] == STOCK


def test_dspatch_env_fixes_every_round_trip():
    ids = [PID, WEIGHTS_ONLY] if _with_weights_only_patch() else [PID]
    proc = run_python(["-m", "dspatch.verify", PID], env=clean_env(DSPATCH=",".join(ids)), warm="base")
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(ids) <= set(outcome["applied"]) and outcome["results"] == ALL_OK
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:") and PID in line]
    assert len(said) == 1 and said[0].startswith("dspatch: applied ") and \
        f"{PID} (deepspeed {deepspeed_version()})" in said[0], said


# In one interpreter: stock first, then dspatch.apply() (a late apply: the targets are already imported), on
# fresh engines each time. What must stay stock, and what the patch must do beyond the reproducers.
OBSERVE = r'''
import gc, json, os, sys, tempfile, weakref
import torch
import dspatch
from dspatch.patches.deepspeed.frozen_param_names import reproducers as F
from dspatch.scenario import init_deepspeed
init_deepspeed()

def files(path):
    out = {}
    for root, _, names in os.walk(path):
        for name in sorted(names):
            if name.endswith(".pt"):
                out[os.path.relpath(os.path.join(root, name), path)] = torch.load(os.path.join(root, name),
                                                                                   weights_only=False)
    return out

def flat(obj, prefix=""):  # tensors and plain values of a checkpoint, by path
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in flat(value, f"{prefix}/{i}").items()}
    if isinstance(obj, torch.Tensor):
        return {prefix: ("tensor", obj.dtype, tuple(obj.shape), obj.detach().flatten().tolist())}
    if isinstance(obj, (int, float, str, bool, type(None))):
        return {prefix: obj}
    if hasattr(obj, "__dict__") and " at 0x" in repr(obj):  # an object (a LossScaler): by its attributes
        return flat(vars(obj), f"{prefix}:{type(obj).__name__}")
    return {prefix: repr(obj)}

def untouched(stage):
    """A job that replaces nothing: checkpoint contents and the shared param_names dict."""
    engine = F.engine_for(stage)
    F.train(engine)
    names, items = engine.param_names, list(engine.param_names.items())
    with tempfile.TemporaryDirectory() as path:
        engine.save_checkpoint(path, tag="t")
        with F._loads_past_weights_only_bug():
            engine.load_checkpoint(path, tag="t")
        saved = {f: {k: v for k, v in flat(c).items() if "ds_version" not in k} for f, c in files(path).items()}
    same = engine.param_names is names and list(engine.param_names.items()) == items
    return saved, same

report = {}
stock = {stage: untouched(stage) for stage in (2, 3)}
verdict = dspatch.apply(["deepspeed/frozen-param-names"], strict=True)["deepspeed/frozen-param-names"][0]
report["late apply"] = verdict
for stage in (2, 3):
    patched = untouched(stage)
    report[f"zero{stage} nothing replaced: same checkpoint"] = patched[0] == stock[stage][0]
    report[f"zero{stage} nothing replaced: param_names untouched"] = [stock[stage][1], patched[1]]

# the shared dict: the optimizer holds the same object, which names the new parameter after a save, and no
# longer holds the replaced one (ZeRO-2: nothing else of DeepSpeed keeps it, except deepspeed.utils.debug's own
# name map, a strong dict before deepspeed 0.19 and a weak one since)
engine = F.engine_for(2)
F.train(engine)
old = weakref.ref(engine.module.base.weight)
new = F.replace_weight(engine, "base.weight", torch.full((8, 8), 0.25), zero3=False)
with tempfile.TemporaryDirectory() as path:
    engine.save_checkpoint(path, tag="t")
    report["shared with the optimizer"] = engine.optimizer.param_names is engine.param_names
    report["new named"] = engine.param_names.get(new)
    report["old key gone"] = old() is None or not any(p is old() for p in engine.param_names)
    gc.collect()
    import deepspeed.utils.debug as debug
    holders = [] if old() is None else [k for k, v in vars(debug).items() if isinstance(v, dict) and any(
        p is old() for p in v)]
    report["old tensor freed, or held by debug only"] = old() is None or holders == ["param_names"]

# a trainable weight replaced: refused at save, and at load, with the same message
engine = F.engine_for(2)
F.train(engine)
with tempfile.TemporaryDirectory() as path:
    engine.save_checkpoint(path, tag="t")
    F.replace_weight(engine, "head.weight", torch.full((1, 8), 0.5), zero3=False)
    for what, call in (("save", lambda: engine.save_checkpoint(path, tag="u")),
                       ("load", lambda: engine.load_checkpoint(path, tag="t"))):
        try:
            with F._loads_past_weights_only_bug():
                call()
            report[f"trainable replaced: {what}"] = "no error"
        except RuntimeError as e:
            report[f"trainable replaced: {what}"] = str(e) == F.REPLACED.format(name="head.weight")
print("R " + json.dumps(report))
'''


def test_nothing_replaced_stays_stock_and_the_shared_dict_is_kept_current():
    proc = run_python(["-c", OBSERVE], warm="stack")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    assert report == {
        "late apply": gating.APPLIED,
        "zero2 nothing replaced: same checkpoint": True,
        "zero2 nothing replaced: param_names untouched": [True, True],
        "zero3 nothing replaced: same checkpoint": True,
        "zero3 nothing replaced: param_names untouched": [True, True],
        "shared with the optimizer": True,
        "new named": "base.weight",
        "old key gone": True,
        "old tensor freed, or held by debug only": True,
        "trainable replaced: save": True,
        "trainable replaced: load": True,
    }


def test_apply_twice_and_revert_restore_upstreams_code():
    code = r'''
import dspatch
from deepspeed.runtime.engine import DeepSpeedEngine
names = ["_get_zero_frozen_param_attributes", "_get_zero_param_shapes", "load_module_state_dict"]
functions = [DeepSpeedEngine.__dict__[n] for n in names]
stock = [f.__code__ for f in functions]
first = dspatch.apply(["deepspeed/frozen-param-names"])["deepspeed/frozen-param-names"][0]
patched = [f.__code__ for f in functions]
second = dspatch.apply(["deepspeed/frozen-param-names"])["deepspeed/frozen-param-names"][0]
same = all(DeepSpeedEngine.__dict__[n] is f and f.__code__ is p for n, f, p in zip(names, functions, patched))
lines = all(p.co_firstlineno == s.co_firstlineno and p.co_filename == s.co_filename for p, s in zip(patched, stock))
dspatch.revert()
print("R", first, second, same, all(p is not s for p, s in zip(patched, stock)), lines,
      all(f.__code__ is s for f, s in zip(functions, stock)))
'''
    out = [line for line in run_python(["-c", code], warm="stack").stdout.splitlines() if line.startswith("R ")][-1]
    assert out == "R applied applied True True True True"


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_frozen_names_diffs_make_the_same_change_in_every_band():
    for relative in registry.all_patches()["deepspeed/frozen-param-names"].diffs.values():
        removed, added = changed_lines(diff_text(relative))
        assert not removed  # one method added, one call in each of the three functions
        calls = [line.strip() for line in added if line.strip().startswith("self._refresh_param_names(")]
        assert calls == ["self._refresh_param_names()", "self._refresh_param_names(check=False)",
                         "self._refresh_param_names(update=False)"], (relative, calls)
