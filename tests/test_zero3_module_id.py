"""deepspeed/zero3-module-id against the real deepspeed of this stack (nox sessions old, mid, latest).

On an affected release: stock reproduces the bug, DSPATCH=1 fixes it, the upstream diff applied to a copy of
the installed deepspeed fixes it with no monkeypatch, and changed source keeps the patch out.
On a fixed release: the patch stays out and upstream's own code passes the same scenarios.
"""
import os
import subprocess

import pytest
from packaging.version import Version

from dspatch import data_dir, gating, registry

from conftest import clean_env, deepspeed_version, run_python, verify

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-module-id"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}
# Upstream's own fix (0.16.4, still in 0.19.8) overwrites a module's own `ds_id` silently: outside this
# patch's range, so pinned here as upstream behaviour; the test notices if upstream changes it.
UPSTREAM_FIXED = {**ALL_OK, "own_ds_id_kept": "bug: the model's own ds_id was overwritten with "}


def upstream_fixed(results):
    return all(results[n].startswith(expected) for n, expected in UPSTREAM_FIXED.items()) and \
        results.keys() == UPSTREAM_FIXED.keys()


def affected():
    return Version(deepspeed_version()) <= Version("0.16.3")


def test_stock_upstream_reproduces_the_bug():
    outcome = verify(PID, clean_env())
    assert outcome["applied"] == []
    results = outcome["results"]
    if affected():
        for name in PATCH.expected_on_stock:
            assert results[name].startswith("bug:"), f"stock deepspeed no longer shows {name}: {results[name]}"
        assert "expert ids [0, 1, 2, 3] became" in results["user_id_survives"]
        assert results["own_ds_id_kept"] == "ok"  # stock <= 0.16.3 writes .id and leaves ds_id alone
    else:
        assert upstream_fixed(results), results


def test_dspatch_env_fixes_it_on_affected_releases_and_stays_out_elsewhere():
    outcome = verify(PID, clean_env(DSPATCH="1"))
    if affected():
        assert outcome["applied"] == [PID]
        assert outcome["results"] == ALL_OK
    else:
        assert outcome["applied"] == [] and upstream_fixed(outcome["results"]), outcome


def test_own_ds_id_is_refused_with_a_clear_message():
    if not affected():
        pytest.skip("deepspeed >= 0.16.4: upstream owns ds_id and the patch stays out")
    code = ("import dspatch; dspatch.apply(['deepspeed/zero3-module-id'], strict=True)\n"
            "from dspatch.scenario import init_deepspeed, zero3_config\n"
            "from dspatch.patches.deepspeed.zero3_module_id import _moe_model\n"
            "ds = init_deepspeed(); m = _moe_model(); m.experts[1].ds_id = 'mine'\n"
            "try:\n    ds.initialize(model=m, config=zero3_config(), model_parameters=m.parameters())\n"
            "except ValueError as e:\n    print('REFUSED', e)\n")
    out = run_python(["-c", code]).stdout
    assert "REFUSED Expert already has an attribute ds_id='mine' that DeepSpeed did not set" in out


def _apply_diff(package_parent, version):
    relative = PATCH.diff_for(version)
    assert relative, f"no upstream diff covers deepspeed {version}"
    diff = os.path.join(data_dir("upstream_prs"), relative)
    subprocess.run(["git", "apply", "--check", diff], cwd=package_parent, check=True)
    subprocess.run(["git", "apply", diff], cwd=package_parent, check=True)
    return diff


def test_upstream_diff_applied_to_a_copy_fixes_it_without_dspatch(deepspeed_copy):
    if not affected():
        pytest.skip("deepspeed >= 0.16.4 already contains the fix; the diff is a backport")
    site, package = deepspeed_copy
    _apply_diff(site, deepspeed_version())
    outcome = verify(PID, clean_env(PYTHONPATH=site))
    assert outcome["applied"] == [] and outcome["results"] == ALL_OK


def test_upstream_diff_is_accepted_by_git_am(deepspeed_copy):
    if not affected():
        pytest.skip("deepspeed >= 0.16.4 already contains the fix")
    site, _ = deepspeed_copy
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    git = lambda *a: subprocess.run(["git", *a], cwd=site, env=env, check=True, capture_output=True, text=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "installed deepspeed")
    git("am", os.path.join(data_dir("upstream_prs"), PATCH.diff_for(deepspeed_version())))
    assert "ds_id" in git("log", "-1", "--format=%s%n%b").stdout


def _drift(package):
    """Change one target function the way a fork or a dev build would."""
    target = PATCH.targets[-1]
    path = os.path.join(package, *target.module.split(".")[1:]) + ".py"
    first, lines = gating.source_segment(path, target.qualname)
    text = open(path).read().split("\n")
    body_indent = " " * (len(lines[0]) - len(lines[0].lstrip()) + 4)
    text.insert(first - 1 + len(lines), f"{body_indent}_local_change = True")
    open(path, "w").write("\n".join(text))


def test_drifted_source_keeps_the_patch_out_and_the_job_running(deepspeed_copy):
    if not affected():
        pytest.skip("the version gate decides first on fixed releases")
    site, package = deepspeed_copy
    _drift(package)
    proc = run_python(["-m", "dspatch.verify", PID, "--only", "user_id_survives"],
                      env=clean_env(PYTHONPATH=site, DSPATCH="1"))
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert len(said) == 1, said  # reported once
    assert "deepspeed/zero3-module-id skipped" in said[0] and "differs from every release" in said[0]
    import json

    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["applied"] == [] and outcome["results"]["user_id_survives"].startswith("bug:")
    # nothing half-applied: every target is upstream's own function
    code = ("import deepspeed.runtime.zero.parameter_offload as po, deepspeed.runtime.zero.partitioned_param_coordinator as pc\n"
            "import wrapt; print(any(isinstance(v, wrapt.FunctionWrapper) or hasattr(v, '__dspatch__') "
            "for c in (po.DeepSpeedZeRoOffload, pc.PartitionedParameterCoordinator) for v in vars(c).values()))")
    assert run_python(["-c", code], env=clean_env(PYTHONPATH=site, DSPATCH="1")).stdout.strip().endswith("False")
    # --check agrees, and --strict turns drift into a non-zero exit
    check = run_python(["-m", "dspatch.apply", "--check", "--strict"], env=clean_env(PYTHONPATH=site), check=False)
    assert check.returncode == 1 and "drifted" in check.stdout


def test_strict_makes_drift_an_import_error(deepspeed_copy):
    if not affected():
        pytest.skip("the version gate decides first on fixed releases")
    site, package = deepspeed_copy
    _drift(package)
    proc = run_python(["-c", "import deepspeed"], env=clean_env(PYTHONPATH=site, DSPATCH="1", DSPATCH_STRICT="1"),
                      check=False)
    assert proc.returncode != 0 and "PatchError" in proc.stderr and "DSPATCH_STRICT=1" in proc.stderr


def test_strict_set_from_code_also_makes_drift_an_import_error(deepspeed_copy):
    if not affected():
        pytest.skip("the version gate decides first on fixed releases")
    site, package = deepspeed_copy
    _drift(package)
    code = "import dspatch; dspatch.apply(['deepspeed/zero3-module-id'], strict=True); import deepspeed"
    proc = run_python(["-c", code], env=clean_env(PYTHONPATH=site), check=False)
    assert proc.returncode != 0 and "PatchError" in proc.stderr and "internal error" not in proc.stderr


def test_import_order_revert_and_idempotence():
    """dspatch.apply() after `import deepspeed` patches at once; twice changes nothing; revert restores."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = r'''
import json, deepspeed, dspatch, wrapt
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as O
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
from dspatch.patches.deepspeed import zero3_module_id as p
from dspatch.spec import BugSeen
originals = {n: vars(O)[n] for n in vars(O)}
def outcome():
    try:
        p.user_id_survives(); return "ok"
    except BugSeen as e:
        return "bug"
first = dspatch.apply(["deepspeed/zero3-module-id"])
wrapped = vars(O)["_register_hooks_recursively"]
second = dspatch.apply(["deepspeed/zero3-module-id"])
report = {"first": first["deepspeed/zero3-module-id"][0], "second": second["deepspeed/zero3-module-id"][0],
          "same_wrapper": vars(O)["_register_hooks_recursively"] is wrapped,
          "is_wrapper": isinstance(wrapped, wrapt.FunctionWrapper),
          # the rebuilt function the guard calls shares upstream's `count=[0]` list, not a fresh one
          "defaults_shared": wrapped._self_wrapper.__defaults__[0].__defaults__[0] is originals["_register_hooks_recursively"].__defaults__[0],
          "patched": outcome()}
try:
    dspatch.revert(); report["plain_revert"] = "reverted"
except RuntimeError as e:  # an engine built under the patch still exists
    report["plain_revert"] = "refused" if "ZeRO-3 engine" in str(e) else str(e)
report["reverted"] = dspatch.revert(force=True)
report["restored"] = all(vars(O)[n] is f for n, f in originals.items())
report["after_revert"] = outcome()
print(json.dumps(report))
'''
    report = __import__("json").loads(run_python(["-c", code]).stdout.strip().splitlines()[-1])
    assert report == {"first": "applied", "second": "applied", "same_wrapper": True, "is_wrapper": True,
                      "defaults_shared": True, "patched": "ok", "plain_revert": "refused", "reverted": [PID],
                      "restored": True, "after_revert": "bug"}


def test_rebuilt_functions_keep_upstream_identity():
    """Names, line numbers and decorators of the rebuilt functions are upstream's (tracebacks stay true)."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = r'''
import json, dspatch, deepspeed, inspect
dspatch.apply(["deepspeed/zero3-module-id"], strict=True)
from dspatch.patches.deepspeed.zero3_module_id import PATCH
from dspatch.rewrite import _functions_in
import sys
import dis
def names(code):  # attributes read or written, in comprehensions and nested functions too
    found = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_ATTR", "STORE_ATTR", "LOAD_METHOD")}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            found |= names(const)
    return found
import wrapt, dspatch._runtime as runtime
rows = []
for qualname, (original, installed) in runtime._applied["deepspeed/zero3-module-id"].originals().items():
    name = qualname.split(".")[1]
    if isinstance(installed, wrapt.FunctionWrapper):  # the guard around the rebuilt function
        installed = installed._self_wrapper.__defaults__[0]
    else:
        assert installed.__dspatch__ == "deepspeed/zero3-module-id"
    new = [f for f in _functions_in(installed) if f.__code__.co_name == name][0]
    old = [f for f in _functions_in(original) if f.__code__.co_name == name][0]
    t = PATCH.targets[[x.qualname for x in PATCH.targets].index(qualname)]
    chain = lambda f: [(g.__code__.co_name, getattr(g, "_torchdynamo_disable", None)) for g in _functions_in(f)]
    assert chain(installed) == chain(original), (qualname, chain(installed), chain(original))  # same decorators
    rows.append([t.qualname, new.__qualname__ == old.__qualname__, new.__code__.co_firstlineno == old.__code__.co_firstlineno,
                 new.__code__.co_filename == old.__code__.co_filename, new.__module__ == old.__module__,
                 "ds_id" in names(new.__code__) and "id" not in names(new.__code__) and "id" in names(old.__code__)])
print(json.dumps(rows))
'''
    rows = __import__("json").loads(run_python(["-c", code]).stdout.strip().splitlines()[-1])
    assert len(rows) == len(PATCH.targets)
    for row in rows:
        assert row[1:] == [True] * 5, row


def test_launcher_forwards_dspatch_to_every_node():
    code = "import deepspeed.launcher.runner as r; print('DSPATCH' in r.EXPORT_ENVS)"
    assert run_python(["-c", code], env=clean_env(DSPATCH="1")).stdout.strip().endswith("True")
    assert run_python(["-c", code], env=clean_env()).stdout.strip().endswith("False")


def test_a_patch_that_fails_part_way_is_rolled_back_whole():
    """An exception after some targets are wrapped leaves every target upstream's own; strict raises."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = r'''
import json, sys, deepspeed, wrapt, dspatch
from dspatch import rewrite
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as O
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
real, calls = rewrite.rebuild, []
def flaky(target, transform, original):  # dspatch's own step fails on the 5th of 9 targets
    calls.append(target.qualname)
    if len(calls) == 5:
        raise RuntimeError("injected failure")
    return real(target, transform, original)
rewrite.rebuild = flaky
result = dspatch.apply(["deepspeed/zero3-module-id"])
wrapped = [n for c in (O, C) for n, v in vars(c).items()
           if isinstance(v, wrapt.FunctionWrapper) or hasattr(v, "__dspatch__")]
calls.clear(); dspatch.revert(force=True)
try:
    dspatch.apply(["deepspeed/zero3-module-id"], strict=True); strict = "no error"
except Exception as e:
    strict = type(e).__name__
print(json.dumps({"verdict": result["deepspeed/zero3-module-id"], "wrapped": wrapped, "strict": strict}))
'''
    proc = run_python(["-c", code])
    report = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert report["verdict"][0] == "failed" and "injected failure" in report["verdict"][1]
    assert report["wrapped"] == [], "half-applied"
    assert report["strict"] == "PatchError"
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert len(said) == 1 and "could not apply" in said[0] and "nothing changed" in said[0]


def test_check_verify_shows_bug_and_fix_on_this_machine():
    proc = run_python(["-m", "dspatch.apply", "--check", "--verify", "--json"], check=False)
    row = __import__("json").loads(proc.stdout)["patches"][0]
    if affected():
        assert proc.returncode == 0, proc.stderr
        assert row["verify"]["ok"] is True
        assert row["verify"]["summary"] == "stock reproduces 2/2, patched passes 3/3"
    else:
        assert "verify" not in row and row["verdict"] == gating.FIXED_UPSTREAM


def test_late_apply_after_an_engine_exists_is_refused_whole():
    """Applying after deepspeed.initialize would make that engine read `.ds_id` it never got: refused."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = ("import dspatch, wrapt\n"
            "from dspatch.patches.deepspeed import zero3_module_id as p\n"
            "from dspatch.spec import BugSeen\n"
            "try:\n    p.user_id_survives()\nexcept BugSeen:\n    pass\n"
            "verdict = dspatch.apply(['deepspeed/zero3-module-id'])['deepspeed/zero3-module-id']\n"
            "from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as O\n"
            "print(verdict[0], any(isinstance(v, wrapt.FunctionWrapper) or hasattr(v, '__dspatch__') "
            "for v in vars(O).values()))")
    proc = run_python(["-c", code])
    assert proc.stdout.strip().splitlines()[-1] == "failed False"
    assert "ZeRO-3 engine(s) exist in this process" in proc.stderr


def test_reloading_a_patched_module_patches_it_again():
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = ("import importlib, wrapt, deepspeed, dspatch._runtime as r\n"
            "import deepspeed.runtime.zero.partitioned_param_coordinator as pc\n"
            "from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as O\n"
            "first = vars(O)['_register_hooks_recursively']\n"
            "importlib.reload(pc)\n"
            "again = vars(O)['_register_hooks_recursively']\n"
            "print(getattr(vars(pc.PartitionedParameterCoordinator)['reset_step'], '__dspatch__', None) == "
            "'deepspeed/zero3-module-id', "
            "again is not first and not isinstance(again.__wrapped__, wrapt.FunctionWrapper), r.applied_ids())\n"
            "from dspatch.patches.deepspeed.zero3_module_id import expert_ids_through_training\n"
            "print(expert_ids_through_training())  # other modules still hold the old classes: both patched\n")
    lines = run_python(["-c", code], env=clean_env(DSPATCH="1")).stdout.splitlines()
    assert f"True True ['{PID}']" in lines  # re-applied whole, never a wrapper around a wrapper
    assert lines[-1] == "([0, 1, 2, 3], [0, 1, 2, 3])"


COPY_AND_REINIT = r'''
import copy, json, sys
if sys.argv[1] == "monkeypatch":
    import dspatch; dspatch.apply(["deepspeed/zero3-module-id"], strict=True)
from dspatch.scenario import init_deepspeed, zero3_config
from dspatch.patches.deepspeed.zero3_module_id import _moe_model, _train
ds = init_deepspeed()
model = _moe_model()
engine, *_ = ds.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
_train(engine, 1)
try:
    twin = copy.deepcopy(model)  # carries DeepSpeed's own ds_id values
except TypeError:  # deepspeed 0.14.x cannot deepcopy a ZeRO-3 model (ZeROOrderedDict): re-register the same one
    twin = model
twin.experts[3].ds_id = 7  # ...and one the user changed afterwards
try:
    ds.initialize(model=twin, config=zero3_config(), model_parameters=twin.parameters())
    print("accepted")
except ValueError as e:
    print("refused " + str(e).split(" that ")[0])
'''


@pytest.mark.parametrize("form", ["monkeypatch", "diff"])
def test_deepspeeds_own_ds_id_survives_a_copy_and_a_changed_one_is_refused(form, deepspeed_copy):
    if not affected():
        pytest.skip("upstream owns ds_id on fixed releases")
    env = clean_env()
    if form == "diff":
        site, _ = deepspeed_copy
        _apply_diff(site, deepspeed_version())
        env = clean_env(PYTHONPATH=site)
    out = run_python(["-c", COPY_AND_REINIT, form], env=env).stdout.strip().splitlines()[-1]
    assert out == "refused Expert already has an attribute ds_id=7", out
