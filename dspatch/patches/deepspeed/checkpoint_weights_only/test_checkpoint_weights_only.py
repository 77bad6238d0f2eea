"""deepspeed/checkpoint-weights-only against the real deepspeed and torch of this stack (nox sessions old, mid,
latest; torch 2.13 everywhere).

On an affected release (old: 0.14.4), in one interpreter with DSPATCH=1, as users run it: the rebuilt loaders are
upstream's function objects (names, files, first lines) with one keyword more; with the patch applied less any one
target, the reproducer that target is for fails with the bug's own message. The zero_to_fp32.py copied into a
checkpoint folder, run as a script, stays broken under DSPATCH=1 and works with the documented
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1; with the upstream diff applied to a copy of the installed deepspeed, the script it
copies into new checkpoints works as it is. Changed source of any one target makes the verdict "drifted"; torch < 2.6
makes it "not affected".
On a fixed release (mid: 0.16.3, latest: 0.19.8): the patch stays out ("fixed upstream") and upstream's own code
passes the same scenarios.
(tests/test_proofs.py and its siblings prove the rest, as for every patch: each scenario's stock failure, exactly as
declared (every ZeRO stage but 0, with either engine); every scenario fixed by the patch and by the diff; drift
caught in a running process.)
"""
import json
import os

import pytest
from packaging.version import Version

from dspatch import gating, registry
from dspatch import upstream

from conftest import STACK, apply_upstream_diff, clean_env, deepspeed_version, run_python, verify
from upstream_releases import changed_lines
from upstream_releases import diff_text
from upstream_releases import member
import ast

pytestmark = pytest.mark.stack

PID = "deepspeed/checkpoint-weights-only"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}
# which reproducer each target is needed for (leaving the target out must make exactly that one fail)
NEEDED_BY = {
    "TorchCheckpointEngine.load": "resume_zero_stages",
    "ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir": "universal_checkpoint",
    "parse_model_states": "zero_to_fp32_module",
    "parse_optim_states": "zero_to_fp32_module",
}

def affected():
    return Version(deepspeed_version()) <= Version("0.15.4")


# One interpreter: patched (DSPATCH=1, every patch active), then stock (this patch reverted), then each target
# left out in turn. The rebuilt code is checked: upstream's names, files and line numbers, plus one keyword. (That
# stock fails exactly as declared and the patch fixes every reproducer: test_proofs.py, test_proofs_fixes.py.)
ONE_PROCESS = r'''
import json, sys
import dspatch
from dspatch import _runtime, registry
from dspatch.rewrite import upstream_function
from dspatch.verify import run_scenarios

PID, NEEDED_BY = sys.argv[1], json.loads(sys.argv[2])
patch = registry.all_patches()[PID]
import deepspeed

def code(t):
    owner = sys.modules[t.module]
    for part in t.qualname.split(".")[:-1]:
        owner = getattr(owner, part)
    return upstream_function(vars(owner)[t.qualname.split(".")[-1]], t, sys.modules[t.module].__file__).__code__

report = {"applied": _runtime.applied_ids()}
patched = {t.qualname: code(t) for t in patch.targets}
dspatch.revert([PID])
stock = {t.qualname: code(t) for t in patch.targets}
report["identity"] = {q: [patched[q].co_name == c.co_name, patched[q].co_firstlineno == c.co_firstlineno,
                          patched[q].co_filename == c.co_filename, "weights_only" in repr(patched[q].co_consts),
                          "weights_only" in repr(c.co_consts)] for q, c in stock.items()}
real, left = _runtime.Transaction.recode, {}
for target in patch.targets:
    def skipping(self, t, *args, _left=target.qualname, **kwargs):
        return None if t.qualname == _left else real(self, t, *args, **kwargs)
    _runtime.Transaction.recode = skipping
    try:
        verdict = dspatch.apply([PID], strict=True)[PID][0]
        left[target.qualname] = [verdict, run_scenarios(patch, only=[NEEDED_BY[target.qualname]])]
    finally:
        _runtime.Transaction.recode = real
        dspatch.revert([PID])
report["left_out"] = left
from dspatch.patches.deepspeed.checkpoint_weights_only.reproducers import _engine, _train
engine = _engine(2)  # for the recovery-script test: save_checkpoint copies the installed zero_to_fp32.py
_train(engine, 0, 1)
engine.save_checkpoint(sys.argv[3], tag="t")
print("R " + json.dumps(report))
'''

# A ZeRO-2 checkpoint saved into sys.argv[1] (with its zero_to_fp32.py). (That the diff fixes every reproducer:
# test_proofs_diffs.py.)
SAVE = r'''
import json, sys
from dspatch import _runtime
from dspatch.patches.deepspeed.checkpoint_weights_only.reproducers import _engine, _train
report = {"applied": _runtime.applied_ids()}
engine = _engine(2)
_train(engine, 0, 1)
engine.save_checkpoint(sys.argv[1], tag="t")
print("R " + json.dumps(report))
'''


def _run_recovery_script(folder, **env):
    """`python <checkpoint>/zero_to_fp32.py <checkpoint> <output>` as users run it (a script: no import hook)."""
    output = os.path.join(folder, "pytorch_model.bin")
    proc = run_python([os.path.join(folder, "zero_to_fp32.py"), folder, output], env=clean_env(**env), check=False, warm="base")
    return proc.returncode == 0 and os.path.isfile(output), proc.stderr


def test_patched_stock_and_each_target_left_out_in_one_process(tmp_path):
    if not affected():
        pytest.skip("deepspeed >= 0.16.0 passes weights_only=False itself: see the fixed-release test")
    folder = str(tmp_path / "ckpt")
    proc = run_python(["-c", ONE_PROCESS, PID, json.dumps(NEEDED_BY), folder], env=clean_env(DSPATCH="1"), warm="stack")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    assert PID in report["applied"]
    # upstream's function objects, names, files and first lines; the code gained the weights_only keyword
    assert report["identity"] == {t.qualname: [True, True, True, True, False] for t in PATCH.targets}
    # every target is necessary: without it, the reproducer it is for fails with the bug's own message
    assert set(report["left_out"]) == set(NEEDED_BY) == {t.qualname for t in PATCH.targets}  # (test_proofs skips it)
    for target, (verdict, results) in report["left_out"].items():
        scenario = NEEDED_BY[target]
        assert verdict == "applied" and list(results) == [scenario], (target, verdict, results)
        assert results[scenario].startswith("bug:") and PATCH.expected_on_stock[scenario] in results[scenario], \
            (target, results)
    # zero_to_fp32.py as save_checkpoint copies it runs as a script (`__main__`), out of reach of dspatch even
    # with DSPATCH=1; the README's workaround, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, makes it work
    ok, stderr = _run_recovery_script(folder, DSPATCH="1")
    assert not ok and "Weights only load failed" in stderr, stderr[-2000:]
    ok, stderr = _run_recovery_script(folder, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    assert ok, stderr[-2000:]


def _apply_diff(package_parent):
    apply_upstream_diff(PATCH, deepspeed_version(), package_parent)


def test_upstream_diff_applied_to_a_copy_fixes_it_without_dspatch(deepspeed_copy):
    if not affected():
        pytest.skip("deepspeed >= 0.16.0 already contains the fix; the diff is a backport")
    site, package = deepspeed_copy
    _apply_diff(site)
    folder = os.path.join(os.path.dirname(site), "ckpt")
    proc = run_python(["-c", SAVE, folder], env=clean_env(PYTHONPATH=site), warm="stack")
    outcome = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    assert outcome["applied"] == []
    # the fixed install's zero_to_fp32.py is what save_checkpoint copies: that script then works as it is
    ok, stderr = _run_recovery_script(folder, PYTHONPATH=site)
    assert ok, stderr[-2000:]
    # the fixed source is upstream's fix, not a release this patch knows: --check keeps the patch out
    assert gating.evaluate(PATCH, locate=lambda m: os.path.join(site, *m.split(".")) + ".py").verdict == gating.DRIFTED


def test_changing_any_one_target_makes_the_verdict_drifted(deepspeed_copy):
    """Every target, in turn, changed as a fork would (one line added): --check's verdict is "drifted" and
    names that target; the unchanged copy "applies"."""
    if not affected():
        pytest.skip("the version gate decides first on fixed releases")
    site, _ = deepspeed_copy

    def locate(module):
        return os.path.join(site, *module.split(".")) + ".py"

    assert gating.evaluate(PATCH, locate=locate).verdict == gating.APPLIES
    for target in PATCH.targets:
        path = locate(target.module)
        original = open(path).read()
        first = upstream.definition(path, target.qualname).body[0]
        lines = original.split("\n")
        lines.insert(first.lineno - 1, " " * first.col_offset + "_local_change = None")
        try:
            open(path, "w").write("\n".join(lines))
            os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
            found = gating.evaluate(PATCH, locate=locate)
            verdict, reason = found.verdict, found.reason
            assert verdict == gating.DRIFTED and str(target) in reason, (target, verdict, reason)
        finally:
            open(path, "w").write(original)
            os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 2 * 10**9))
    assert gating.evaluate(PATCH, locate=locate).verdict == gating.APPLIES


def _check_row(env):
    rows = json.loads(run_python(["-m", "dspatch.apply", "--check", "--json"], env=env).stdout)["patches"]
    return next(row for row in rows if row["id"] == PID)


def test_check_says_torch_decides(tmp_path):
    """--check with this stack's torch (2.13), and with torch 2.5.1's metadata first on the path (what an
    environment with torch < 2.6 shows): "not affected", saying which torch it saw."""
    row = _check_row(clean_env())
    if affected():
        assert row["verdict"] == gating.APPLIES, row
    else:
        assert row["verdict"] == gating.FIXED_UPSTREAM and row["reason"] == "fixed upstream in 0.16.0", row
        return
    meta = tmp_path / "torch-2.5.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n")
    row = _check_row(clean_env(PYTHONPATH=str(tmp_path)))
    assert row["verdict"] == gating.NOT_AFFECTED, row
    assert row["reason"] == "the bug needs torch>=2.6; torch 2.5.1 is installed", row


def test_fixed_releases_keep_the_patch_out_and_round_trip_on_stock():
    if affected():
        pytest.skip("affected release: see the tests above")
    if STACK != "latest":  # CI time: the newest fixed release's own code; every release's verdict: unit session
        pytest.skip("run on the latest stack (the newest fixed release); verdicts of the others: test_releases.py")
    assert gating.evaluate(PATCH).verdict == gating.FIXED_UPSTREAM
    outcome = verify(PID, clean_env(DSPATCH="1"))  # every patch active, as users run it
    assert PID not in outcome["applied"] and outcome["results"] == ALL_OK, outcome


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

WEIGHTS_ONLY = registry.all_patches()["deepspeed/checkpoint-weights-only"]
LOADERS = ("deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py", "deepspeed/runtime/base_optimizer.py",
           "deepspeed/utils/zero_to_fp32.py")


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_weights_only_torch_gate_edges():
    def verdict(torch_version):
        return gating.evaluate(WEIGHTS_ONLY, version="0.15.4", locate=lambda m: None,
                               others={"torch": torch_version}).verdict

    assert verdict("2.5.1") == verdict("2.4.0") == verdict(None) == gating.NOT_AFFECTED
    # 2.6.0 and its local/pre builds are judged as 2.6 (then the source decides: no files here -> drifted)
    assert verdict("2.6.0") == verdict("2.6.0+cpu") == verdict("2.6.0rc1") == gating.DRIFTED


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_weights_only_diff_adds_one_keyword_to_each_load():
    (relative,) = WEIGHTS_ONLY.diffs.values()
    removed, added = changed_lines(diff_text(relative))
    assert len(removed) == len(added) == 4  # the diff and the monkeypatch make the same change
    for old, new in zip(removed, added):
        assert "weights_only" not in old and new == old[:-1] + ", weights_only=False)", (old, new)


def _torch_loads(tree):
    """{(qualname of the innermost def, has weights_only)} for every `torch.load(...)` call in a module."""
    found = set()

    def visit(node, names):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, names + [child.name])
                continue
            if isinstance(child, ast.Call) and ast.unparse(child.func) == "torch.load":
                found.add((".".join(names), any(k.arg == "weights_only" for k in child.keywords)))
            visit(child, names)

    visit(tree, [])
    return found


@pytest.mark.unit_only  # released sources only: once, in the unit session
@pytest.mark.parametrize("version", ["0.14.1", "0.14.4", "0.15.4", "0.16.0"])
def test_weights_only_targets_are_every_torch_load_of_these_loaders(version):
    """In the three files the patch touches, its targets are exactly the functions that call torch.load
    without weights_only (none are left once upstream's fix is in, 0.16.0)."""
    loads = {}
    for relative in LOADERS:
        source = member("deepspeed", version, relative)
        module = relative[:-3].replace("/", ".")
        loads.update({(module, q): has for q, has in _torch_loads(ast.parse(source))})
    unset = {key for key, has in loads.items() if not has}
    if Version(version) >= Version("0.16.0"):
        assert unset == set() and len(loads) == len(WEIGHTS_ONLY.targets)
    else:
        assert unset == {(t.module, t.qualname) for t in WEIGHTS_ONLY.targets}
