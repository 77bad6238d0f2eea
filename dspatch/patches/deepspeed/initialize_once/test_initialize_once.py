"""deepspeed/initialize-once against the real deepspeed of this stack (nox sessions old, mid, latest).

Stock reproduces each corruption exactly (pinned per release line), DSPATCH=1 refuses before anything changes
(the first engine's losses stay bit-identical to an engine that never saw the second call), the upstream diff
applied to a copy of the installed deepspeed does the same with no monkeypatch, and every row of the table in
the patch's docstring is checked on real code, stock and patched, in one subprocess per stack.
"""
import json

import pytest

from dspatch import gating, registry

from conftest import clean_env, deepspeed_version, run_python, verify
from dspatch import data_dir
from test_releases import RELEASES
from test_releases import _tree
from upstream_releases import diff_text
import os
import subprocess

pytestmark = pytest.mark.stack

PID = "deepspeed/initialize-once"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}


def _old_line():
    from packaging.version import Version

    return Version(deepspeed_version()) < Version("0.17")


def _zero2_breaks_the_second_engine():
    """ZeRO-2 reuse: up to 0.16.3 the first engine breaks at once; 0.16.9 (bridge) already fails in the second
    engine's first backward, as 0.19.8 does (0.16.4-0.16.8 are not run here)."""
    from packaging.version import Version

    return Version(deepspeed_version()) > Version("0.16.3")


def _deque_after_inference():
    """A ZeRO-3 inference engine's single forward fails the next engine's first forward from 0.15.4 (0.14.4 trains)."""
    from packaging.version import Version

    return Version(deepspeed_version()) >= Version("0.15.4")


def stock_results():
    """What stock shows, exactly. Up to 0.16.x ZeRO-2 breaks the first engine at once; 0.19.8 breaks at the
    second engine's first backward (and the first engine with it)."""
    went = "bug: second deepspeed.initialize on the model of a live ZeRO-{} engine went through; "
    zero2 = (went.format(2) + "the first engine's next step: AttributeError: 'DeepSpeedZeroOptimizer' object has "
             "no attribute 'ipg_index'") if not _zero2_breaks_the_second_engine() else (
        went.format(2) + "the second engine's first step: AssertionError: The parameter "
        f"{'3' if _old_line() else '2.bias'} has already been reduced. Gradient computed twice for this partition. "
        "Multiple gradient reduction is currently not supported")
    return {
        "zero2_same_model": zero2,
        "zero3_same_model": went.format(3) + "the second engine's first step: AssertionError (partitioned twice)",
        "zero1_same_optimizer": "bug: second deepspeed.initialize with the optimizer of a live ZeRO-1 engine went "
                                "through until KeyError (a parameter tensor) part-way; the first engine's losses "
                                "changed from step 3",
        "zero0_same_model_warns": "bug: second deepspeed.initialize on the model of a live ZeRO-0 engine went "
                                  "through without a word",
        "allowed_calls": "ok",
        "inference_then_training": "ok",
    }


def test_this_stack_is_covered():
    assert gating.evaluate(PATCH).verdict == gating.APPLIES


def test_stock_upstream_reproduces_each_corruption_exactly():
    outcome = verify(PID, clean_env())
    assert outcome["applied"] == [] and outcome["results"] == stock_results()


# ----------------------------------------------------------------------------------------------------
# The table: each row once stock, then (in the same process, dspatch.apply) patched.

TABLE = r'''
import json, sys, warnings
from dspatch.patches.deepspeed.initialize_once import reproducers as io

def short(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())[:90]}"

def attempt(fn):
    try:
        return "ok", fn()
    except Exception as e:
        return short(e), None

REFS = {}
def ref(stage, opt=False):
    if (stage, opt) not in REFS:
        REFS[stage, opt] = io.reference(stage, optimizer=opt)
    return REFS[stage, opt]

def row(kind, s1, s2):
    io.warm_up()
    opt = kind.startswith("optimizer")
    want = ref(s1, opt)
    model = io.make_model()
    optimizer = io._adamw(model) if opt else None
    if kind == "inference":  # one forward of an engine with no optimizer, then a training engine on the model
        first = io.make_engine(model, s1, inference=True)
        io._inference_forward(first)
        second = attempt(lambda: io.make_engine(model, s2))
        status, engine = second
        out = {"second": "refused" if status.startswith("InitializeTwiceError") and io.REFUSED in status else status}
        if engine is not None:
            engine.train()
            got = attempt(lambda: io.train(engine, range(4)))
            out["second engine"] = ("identical" if got[1] == io.reference(s2) else "changed") if got[0] == "ok" \
                else got[0]
        return out
    first = io.make_engine(model, s1, optimizer)
    done = io.train(first, range(2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if kind == "same model":
            second = attempt(lambda: io.make_engine(model, s2))
        elif kind == "engine as model":
            second = attempt(lambda: io.make_engine(first, s2))
        elif kind == "optimizer":
            second = attempt(lambda: io.make_engine(io.make_model(), s2, optimizer))
        elif kind == "different model":
            second = attempt(lambda: io.make_engine(io.make_model(), s2))
        elif kind == "after destroy":
            first.destroy()
            second = attempt(lambda: io.make_engine(model, s2))
    warned = sum("is already in use by a live" in str(w.message) for w in seen)
    status, engine = second
    if status.startswith("InitializeTwiceError") and io.REFUSED in status:
        status = "refused"
    out = {"second": status, "warned": warned}
    if kind != "after destroy":
        got = attempt(lambda: done + io.train(first, range(2, 4)))
        out["first"] = ("identical" if got[1] == want else "changed") if got[0] == "ok" else got[0]
    if engine is not None:
        out["second engine"] = attempt(lambda: io.train(engine, range(4, 5)))[0]
    return out

ROWS = json.loads(sys.argv[1])
report = {"stock": {}, "patched": {}}
for key in ROWS:
    report["stock"][key] = row(*ROWS[key])
import dspatch
from dspatch.patches.deepspeed import initialize_once as fix
assert dspatch.apply([fix.PID], strict=True)[fix.PID][0] == "applied"
fix._warned.clear()
for key in ROWS:
    report["patched"][key] = row(*ROWS[key])
    fix._warned.clear()  # "once" per process: each row starts fresh
print("R " + json.dumps(report))
'''

ROWS = {  # name: (kind, first engine's stage, second call's stage)
    "same model 0->0": ("same model", 0, 0),
    "same model 1->1": ("same model", 1, 1),
    "same model 2->2": ("same model", 2, 2),
    "same model 3->3": ("same model", 3, 3),
    "same model 0->3": ("same model", 0, 3),
    "engine as model 2->2": ("engine as model", 2, 2),
    "engine as model 3->3": ("engine as model", 3, 3),
    "same optimizer 0": ("optimizer", 0, 0),
    "same optimizer 2": ("optimizer", 2, 2),
    "same optimizer 3": ("optimizer", 3, 3),
    "different model 3->3": ("different model", 3, 3),
    "after destroy 3->3": ("after destroy", 3, 3),
    "inference 3->3": ("inference", 3, 3),
    "inference 0->2": ("inference", 0, 2),
    "inference 0->3": ("inference", 0, 3),
    "inference 3->2": ("inference", 3, 2),
}
HARMLESS = {"same model 0->0", "same model 1->1", "same optimizer 0"}
ALLOWED = {"different model 3->3", "after destroy 3->3"}


@pytest.fixture(scope="module")
def table():
    proc = run_python(["-c", TABLE, json.dumps(ROWS)], warm="stack")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])


def _stock_corruption(name, stock):
    """What stock does on a corrupting row, pinned."""
    old = _old_line()
    if name in ("same model 2->2", "engine as model 2->2"):
        if not _zero2_breaks_the_second_engine():
            return stock["second"] == "ok" and stock["first"] == ("AttributeError: 'DeepSpeedZeroOptimizer' object "
                                                                   "has no attribute 'ipg_index'")
        if name == "engine as model 2->2" and not old:  # the new engine wraps the old one: fails another way
            return stock["second"] == "ok" and stock["first"] == "identical" and \
                stock["second engine"] == "AttributeError: 'NoneType' object has no attribute 'view'"
        return stock["second"] == "ok" and stock["first"] == "identical" and \
            stock["second engine"].startswith("AssertionError: The parameter") and \
            "has already been reduced" in stock["second engine"]
    if name == "engine as model 3->3" and not old:  # the new engine wraps the old one
        return stock["second"] == "ok" and stock["first"] == "identical" and \
            stock["second engine"] == "AttributeError: 'NoneType' object has no attribute 'numel'"
    if name in ("same model 3->3", "engine as model 3->3"):
        return stock["second"] == "ok" and stock["first"] == "identical" and stock["second engine"] == "AssertionError: "
    if name == "same model 0->3":
        return stock["second"] == "ok" and stock["first"].startswith("RuntimeError: The size of tensor a (0) must match")
    if name == "same optimizer 2":
        return stock["second"].startswith("KeyError: ") and stock["first"] in ("changed",) + (
            () if old else ("AttributeError: 'DeepSpeedEngine' object has no attribute 'engine_timers'",))
    if name == "same optimizer 3":
        return stock["second"] == "IndexError: list index out of range" and \
            stock["first"] in ("IndexError: list index out of range",
                               "AttributeError: 'DeepSpeedEngine' object has no attribute 'engine_timers'")
    raise AssertionError(name)


@pytest.mark.parametrize("name", list(ROWS))
def test_table(name, table):
    stock, patched = table["stock"][name], table["patched"][name]
    if name == "inference 3->2":  # the inference engine's ZeRO-3 partitions under a ZeRO-2 engine
        assert stock["second"] != "refused" and stock.get("second engine") != "identical", stock
        assert patched == {"second": "refused"}, patched
    elif name.startswith("inference"):  # through as on stock (one ZeRO-3 forward: stock's deque from 0.15.4)
        deque = name == "inference 3->3" and _deque_after_inference()
        assert stock == {"second": "ok", "second engine": "IndexError: pop from an empty deque" if deque
                         else "identical"}, stock
        assert patched == stock, patched
    elif name in HARMLESS:
        assert stock == {"second": "ok", "warned": 0, "first": "identical", "second engine": "ok"}, stock
        assert patched == {"second": "ok", "warned": 1, "first": "identical", "second engine": "ok"}, patched
    elif name in ALLOWED:
        assert stock["second"] == "ok" and stock["warned"] == 0 and stock["second engine"] == "ok", stock
        assert patched == stock, patched
    else:
        assert _stock_corruption(name, stock), stock
        assert patched == {"second": "refused", "warned": 0, "first": "identical"}, patched


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_initialize_once_each_release_takes_its_own_bands_diff_and_no_other():
    patch = registry.all_patches()["deepspeed/initialize-once"]
    for version in RELEASES["deepspeed/initialize-once"]:
        root, _ = _tree("deepspeed/initialize-once", version)
        for relative in patch.diffs.values():
            check = subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), relative)],
                                   cwd=root, capture_output=True)
            assert (check.returncode == 0) == (relative == patch.diff_for(version)), (version, relative)
    for relative in patch.diffs.values():
        assert "create mode 100644 deepspeed/runtime/initialize_guard.py" in diff_text(relative)
