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
from dspatch import upstream

from conftest import apply_upstream_diff, clean_env, deepspeed_version, run_python, verify
from packaging.specifiers import SpecifierSet
from upstream_releases import extract_modules
from upstream_releases import release_versions
from upstream_releases import sdist
import ast
import tarfile

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-module-id"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}
# Upstream's own fix (0.16.4, still in 0.19.8) overwrites a module's own `ds_id` silently: outside this
# patch's range, so pinned here as upstream behaviour; the test notices if upstream changes it.
UPSTREAM_FIXED = {**ALL_OK, "own_ds_id_kept": "bug: the model's own ds_id was overwritten with "}


# For every target: whether the function deepspeed's class attribute leads to (upstream's own function object)
# runs patched code, which reads no module `.id`. Appended to the subprocess probes below.
TARGET_STATE = r'''
def _attributes(code):
    import dis
    found = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_ATTR", "STORE_ATTR", "LOAD_METHOD")}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            found |= _attributes(const)
    return found

def target_state():
    import sys
    from dspatch import registry
    from dspatch.rewrite import upstream_function
    patch = registry.all_patches()["deepspeed/zero3-module-id"]
    state = {}
    for t in patch.targets:
        owner = sys.modules[t.module]
        *path, name = t.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = upstream_function(vars(owner)[name], t, sys.modules[t.module].__file__)
        state[t.qualname] = "id" not in _attributes(fn.__code__)  # stock reads module.id (and param.ds_id)
    return state
'''


def _reported_lines(code):
    """The lines a probe printed after "R " (deepspeed prints its own config on stdout too), under DSPATCH=PID."""
    out = run_python(["-c", code], env=clean_env(DSPATCH=PID), warm="stack").stdout
    return [line[2:] for line in out.splitlines() if line.startswith("R ")]


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
    outcome = verify(PID, clean_env(DSPATCH="1"))  # every patch active, as users run it
    if affected():
        assert PID in outcome["applied"]
        assert outcome["results"] == ALL_OK
    else:
        assert PID not in outcome["applied"] and upstream_fixed(outcome["results"]), outcome


def test_own_ds_id_is_refused_with_a_clear_message():
    if not affected():
        pytest.skip("deepspeed >= 0.16.4: upstream owns ds_id and the patch stays out")
    code = ("import dspatch; dspatch.apply(['deepspeed/zero3-module-id'], strict=True)\n"
            "from dspatch.scenario import init_deepspeed, zero3_config\n"
            "from dspatch.patches.deepspeed.zero3_module_id.reproducers import _moe_model\n"
            "ds = init_deepspeed(); m = _moe_model(); m.experts[1].ds_id = 'mine'\n"
            "try:\n    ds.initialize(model=m, config=zero3_config(), model_parameters=m.parameters())\n"
            "except ValueError as e:\n    print('REFUSED', e)\n")
    out = run_python(["-c", code], warm="stack").stdout
    assert "REFUSED Expert already has an attribute ds_id='mine' that DeepSpeed did not set" in out


def _apply_diff(package_parent, version):
    return apply_upstream_diff(PATCH, version, package_parent)


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
    first, lines = upstream.source_segment(path, target.qualname)
    text = open(path).read().split("\n")
    body_indent = " " * (len(lines[0]) - len(lines[0].lstrip()) + 4)
    text.insert(first - 1 + len(lines), f"{body_indent}_local_change = True")
    open(path, "w").write("\n".join(text))


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_drifted_source_keeps_the_patch_out_and_the_job_running(deepspeed_copy):
    if not affected():
        pytest.skip("the version gate decides first on fixed releases")
    site, package = deepspeed_copy
    _drift(package)
    proc = run_python(["-m", "dspatch.verify", PID, "--only", "user_id_survives"],
                      env=clean_env(PYTHONPATH=site, DSPATCH="1"), warm="base")
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:") and PID in line]
    assert len(said) == 1, said  # reported once
    assert "deepspeed/zero3-module-id skipped" in said[0] and "differs from every release" in said[0]
    import json

    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert PID not in outcome["applied"] and outcome["results"]["user_id_survives"].startswith("bug:")
    # nothing half-applied: every target is upstream's own function
    code = TARGET_STATE + "import deepspeed\nprint(any(target_state().values()))"
    assert run_python(["-c", code], env=clean_env(PYTHONPATH=site, DSPATCH="1"), warm="base").stdout.strip().endswith("False")
    # --check agrees, and --strict turns drift into a non-zero exit
    check = run_python(["-m", "dspatch.apply", "--check", "--strict"], env=clean_env(PYTHONPATH=site), check=False)
    assert check.returncode == 1 and "drifted" in check.stdout


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_strict_makes_drift_an_import_error(deepspeed_copy):
    if not affected():
        pytest.skip("the version gate decides first on fixed releases")
    site, package = deepspeed_copy
    _drift(package)
    proc = run_python(["-c", "import deepspeed"], env=clean_env(PYTHONPATH=site, DSPATCH="1", DSPATCH_STRICT="1"),
                      check=False, warm="base")
    assert proc.returncode == 1 and proc.stderr.startswith("dspatch: deepspeed/zero3-module-id: ") and \
        "strict mode (DSPATCH_STRICT=1) stops the job" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_strict_set_from_code_also_makes_drift_an_import_error(deepspeed_copy):
    if not affected():
        pytest.skip("the version gate decides first on fixed releases")
    site, package = deepspeed_copy
    _drift(package)
    code = "import dspatch; dspatch.apply(['deepspeed/zero3-module-id'], strict=True); import deepspeed"
    proc = run_python(["-c", code], env=clean_env(PYTHONPATH=site), check=False, warm="base")
    assert proc.returncode == 1 and "strict mode" in proc.stderr and "internal error" not in proc.stderr, proc.stderr


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_import_order_revert_and_idempotence():
    """dspatch.apply() after `import deepspeed` patches at once; twice changes nothing; revert restores."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = TARGET_STATE + r'''
import json, deepspeed, dspatch
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as O
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
from dspatch.patches.deepspeed.zero3_module_id import reproducers as p
from dspatch.spec import BugSeen
attributes = {(c, n): v for c in (O, C) for n, v in vars(c).items()}
codes = {n: f.__code__ for n, f in vars(C).items() if hasattr(f, "__code__")}
def outcome():
    try:
        p.user_id_survives(); return "ok"
    except BugSeen as e:
        return "bug"
first = dspatch.apply(["deepspeed/zero3-module-id"])
patched_codes = {n: f.__code__ for n, f in vars(C).items() if hasattr(f, "__code__")}
second = dspatch.apply(["deepspeed/zero3-module-id"])
report = {"first": first["deepspeed/zero3-module-id"][0], "second": second["deepspeed/zero3-module-id"][0],
          "patched_state": all(target_state().values()),
          # nothing replaced: every attribute is upstream's own object, the code inside it changed once
          "same_objects": all(vars(c)[n] is v for (c, n), v in attributes.items()),
          "applied_once": all(f.__code__ is patched_codes[n] for n, f in vars(C).items() if hasattr(f, "__code__")),
          # upstream's `count=[0]` default is the function's own, untouched
          "defaults_kept": vars(O)["_register_hooks_recursively"].__defaults__[0] is attributes[(O, "_register_hooks_recursively")].__defaults__[0],
          "patched": outcome()}
try:
    dspatch.revert(); report["plain_revert"] = "reverted"
except RuntimeError as e:  # an engine built under the patch still exists
    report["plain_revert"] = "refused" if "ZeRO-3 engine" in str(e) else str(e)
report["reverted"] = dspatch.revert(force=True)
report["restored"] = all(f.__code__ is codes[n] for n, f in vars(C).items() if hasattr(f, "__code__")) and \
    not any(target_state().values())
report["after_revert"] = outcome()
print(json.dumps(report))
'''
    report = __import__("json").loads(run_python(["-c", code], warm="stack").stdout.strip().splitlines()[-1])
    assert report == {"first": "applied", "second": "applied", "patched_state": True, "same_objects": True,
                      "applied_once": True, "defaults_kept": True, "patched": "ok", "plain_revert": "refused",
                      "reverted": [PID], "restored": True, "after_revert": "bug"}


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_rebuilt_code_keeps_upstream_identity():
    """Names, line numbers, files and decorators of the patched functions are upstream's (tracebacks stay
    true); the code reads `.ds_id` where upstream's read `.id`, and nothing else."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = TARGET_STATE + r'''
import json, sys, dspatch, deepspeed
from dspatch import registry
from dspatch.rewrite import upstream_function
patch = registry.all_patches()["deepspeed/zero3-module-id"]
def fn(t):
    owner = sys.modules[t.module]
    for part in t.qualname.split(".")[:-1]:
        owner = getattr(owner, part)
    return upstream_function(vars(owner)[t.qualname.split(".")[-1]], t, sys.modules[t.module].__file__)
before = {t.qualname: fn(t).__code__ for t in patch.targets}
dspatch.apply(["deepspeed/zero3-module-id"], strict=True)
rows = []
for t in patch.targets:
    old, new = before[t.qualname], fn(t).__code__
    added = _attributes(new) - _attributes(old)
    removed = _attributes(old) - _attributes(new)
    rows.append([t.qualname, new.co_name == old.co_name, new.co_firstlineno == old.co_firstlineno,
                 new.co_filename == old.co_filename, new.co_freevars == old.co_freevars,
                 sorted(added), sorted(removed)])
print(json.dumps(rows))
'''
    rows = __import__("json").loads(run_python(["-c", code], warm="stack").stdout.strip().splitlines()[-1])
    assert len(rows) == len(PATCH.targets)
    for row in rows:
        assert row[1:5] == [True] * 4, row
        allowed = {"ds_id"} | ({"_ds_id_assigned", "format"} if row[0].endswith("_register_hooks_recursively") else set())
        assert set(row[5]) <= allowed and row[6] == ["id"], row


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_importing_the_launcher_adds_dspatch_to_its_export_list():
    """Only the launcher's list is checked here (no launcher runs: see the launcher tests)."""
    code = "import deepspeed.launcher.runner as r; print('DSPATCH' in r.EXPORT_ENVS)"
    assert run_python(["-c", code], env=clean_env(DSPATCH="1"), warm="base").stdout.strip().endswith("True")
    assert run_python(["-c", code], env=clean_env(), warm="base").stdout.strip().endswith("False")


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_a_patch_that_fails_part_way_is_rolled_back_whole():
    """An exception after some targets are wrapped leaves every target upstream's own; strict raises."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = TARGET_STATE + r'''
import json, sys, deepspeed, dspatch
from dspatch import rewrite
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as O
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
real, calls = rewrite.rebuild_code, []
def flaky(target, transform, function):  # dspatch's own step fails part-way (the 5th rebuilt code: cached or not)
    calls.append(target.qualname)
    if len(calls) == 5:
        raise RuntimeError("injected failure")
    return real(target, transform, function)
rewrite.rebuild_code = flaky
result = dspatch.apply(["deepspeed/zero3-module-id"])
wrapped = [n for n, patched in target_state().items() if patched]
calls.clear(); dspatch.revert(force=True)
try:
    dspatch.apply(["deepspeed/zero3-module-id"], strict=True); strict = "no error"
except Exception as e:
    strict = type(e).__name__
print(json.dumps({"verdict": result["deepspeed/zero3-module-id"], "wrapped": wrapped, "strict": strict}))
'''
    proc = run_python(["-c", code], warm="stack")
    report = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert report["verdict"][0] == "failed" and "injected failure" in report["verdict"][1]
    assert report["wrapped"] == [], "half-applied"
    assert report["strict"] == "PatchError"
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert len(said) == 1 and "could not apply" in said[0] and "nothing changed" in said[0]


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_check_verify_shows_bug_and_fix_on_this_machine():
    proc = run_python(["-m", "dspatch", "verify", PID, "--json", "--device", "cpu"], check=False)
    if affected():
        assert proc.returncode == 0, proc.stderr
        row = {r["id"]: r for r in __import__("json").loads(proc.stdout)["patches"]}[PID]
        assert row["verify"]["ok"] is True
        assert row["verify"]["summary"] == "stock reproduces 3/3, patched passes 4/4"
        # progress while it runs, and (plain output, from the same results) what each reproducer saw
        progress = [line for line in proc.stderr.splitlines() if line.startswith("dspatch: patch 1 of 1: ")]
        assert [line.split(": ")[3].split(" (")[0].split(" done")[0] for line in progress] == \
            ["stock", "stock", "patched", "patched"], progress
        # the plain rendering of these same results (the reproducers are not run a second time)
        shown = run_python(["-c", "import sys, dspatch.cli as a, json; rows = json.loads(sys.stdin.read()); "
                                  "a._verify = lambda patch, *args, **kwargs: (rows['ok'], rows['summary'], "
                                  "rows['scenarios']); sys.exit(a.main(['verify', sys.argv[1], '--device', 'cpu']))",
                            PID], input=__import__("json").dumps(row["verify"]), check=False).stdout
        assert "    placement_during_training: stock: bug: ZeRO-3 prefetch bookkeeping broke: IndexError: pop " \
               "from an empty deque; patched: ok" in shown, shown
    else:  # fixed upstream: nothing to verify, and it says so
        assert proc.returncode == 5 and f"{PID}: fixed upstream" in proc.stderr, proc.stderr


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_late_apply_after_an_engine_exists_is_refused_whole():
    """Applying after deepspeed.initialize would make that engine read `.ds_id` it never got: refused."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = TARGET_STATE + (
        "import dspatch\n"
        "from dspatch.patches.deepspeed.zero3_module_id import reproducers as p\n"
        "from dspatch.spec import BugSeen\n"
        "try:\n    p.user_id_survives()\nexcept BugSeen:\n    pass\n"
        "verdict = dspatch.apply(['deepspeed/zero3-module-id'])['deepspeed/zero3-module-id']\n"
        "print(verdict[0], any(target_state().values()), [r for r in dspatch.check() if r['id'] == 'deepspeed/zero3-module-id'][0]['verdict'])")
    proc = run_python(["-c", code], warm="base")
    assert proc.stdout.strip().splitlines()[-1] == "failed False failed"
    assert "ZeRO-3 engine(s) exist in this process" in proc.stderr


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_reloading_a_patched_module_patches_it_again():
    """importlib.reload re-creates a module's classes: the new ones are patched too (once, whole), and the old
    ones, which other modules still hold, stay patched, so both numberings never mix."""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = TARGET_STATE + (
        "import importlib, deepspeed, dspatch._runtime as r\n"
        "import deepspeed.runtime.zero.partitioned_param_coordinator as pc\n"
        "import deepspeed.runtime.zero.parameter_offload as po\n"
        "old = pc.PartitionedParameterCoordinator\n"
        "importlib.reload(pc)\n"
        "print('R', old is not pc.PartitionedParameterCoordinator, all(target_state().values()), "
        "'id' not in _attributes(vars(old)['fetch_sub_module'].__code__), r.applied_ids())\n"
        "from dspatch.patches.deepspeed.zero3_module_id.reproducers import expert_ids_through_training\n"
        "print('R', expert_ids_through_training())  # parameter_offload still holds the old class\n"
        "importlib.reload(po)  # and the other module\n"
        "print('R', all(target_state().values()), expert_ids_through_training())\n")
    lines = _reported_lines(code)
    assert lines == [f"True True True ['{PID}']", "([0, 1, 2, 3], [0, 1, 2, 3])",
                     "True ([0, 1, 2, 3], [0, 1, 2, 3])"]


COPY_AND_REINIT = r'''
import copy, json, sys
if sys.argv[1] == "monkeypatch":
    import dspatch; dspatch.apply(["deepspeed/zero3-module-id"], strict=True)
from dspatch.scenario import init_deepspeed, zero3_config
from dspatch.patches.deepspeed.zero3_module_id.reproducers import _moe_model, _train
ds = init_deepspeed()
model = _moe_model()
engine, *_ = ds.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
_train(engine, 1)
try:
    twin, how = copy.deepcopy(model), "copy"  # carries DeepSpeed's own ds_id values
except TypeError:  # deepspeed 0.14.x cannot deepcopy a ZeRO-3 model (ZeROOrderedDict): re-register the same one
    twin, how = model, "same model"
ds.initialize(model=twin, config=zero3_config(), model_parameters=twin.parameters())  # DeepSpeed's own: fine
twin.experts[3].ds_id = 7  # ...and one the user changed afterwards
try:
    ds.initialize(model=twin, config=zero3_config(), model_parameters=twin.parameters())
    print(how, "accepted")
except ValueError as e:
    print(how, "refused " + str(e).split(" that ")[0])
'''


@pytest.mark.parametrize("form", ["monkeypatch", "diff"])
def test_deepspeeds_own_ds_id_is_recognised_on_a_copy_and_a_changed_one_is_refused(form, deepspeed_copy):
    """On a deepcopy of a ZeRO-3 model where the release can make one (0.15+); 0.14.x cannot deepcopy it, so
    there the same model is registered again, and the test says which it did."""
    if not affected():
        pytest.skip("upstream owns ds_id on fixed releases")
    env = clean_env()
    if form == "diff":
        site, _ = deepspeed_copy
        _apply_diff(site, deepspeed_version())
        env = clean_env(PYTHONPATH=site)
    out = run_python(["-c", COPY_AND_REINIT, form], env=env, warm="stack").stdout.strip().splitlines()[-1]
    how = "same model" if Version(deepspeed_version()) < Version("0.15") else "copy"
    assert out == f"{how} refused Expert already has an attribute ds_id=7", out


@pytest.mark.machinery  # dspatch's runtime, shown on this patch
def test_a_fresh_import_after_sys_modules_was_purged_is_patched_too():
    """The README's purge case: the patched modules dropped from sys.modules and imported again (as some test
    runners and notebooks do): the new classes are patched, the job keeps the experts' ids. (Purging all of
    deepspeed cannot work on stock 0.14: its pydantic validators refuse to be defined twice.)"""
    if not affected():
        pytest.skip("nothing to apply on a fixed release")
    code = TARGET_STATE + (
        "import sys, deepspeed, dspatch._runtime as r\n"
        "from dspatch.patches.deepspeed.zero3_module_id.reproducers import expert_ids_through_training\n"
        "first = expert_ids_through_training()\n"
        "old = sys.modules['deepspeed.runtime.zero.partitioned_param_coordinator'].PartitionedParameterCoordinator\n"
        "for name in ('deepspeed.runtime.zero.partitioned_param_coordinator', "
        "'deepspeed.runtime.zero.parameter_offload'):\n"
        "    del sys.modules[name]\n"
        "import deepspeed.runtime.zero.parameter_offload\n"
        "new = sys.modules['deepspeed.runtime.zero.partitioned_param_coordinator'].PartitionedParameterCoordinator\n"
        "print('R', new is not old, all(target_state().values()), r.applied_ids(), first, "
        "expert_ids_through_training())\n")
    lines = _reported_lines(code)
    assert lines == [f"True True ['{PID}'] ([0, 1, 2, 3], [0, 1, 2, 3]) ([0, 1, 2, 3], [0, 1, 2, 3])"], lines


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

MODULE_ID = registry.all_patches()["deepspeed/zero3-module-id"]


@pytest.mark.unit_only  # released sources only: once, in the unit session
@pytest.mark.parametrize("version, files, expected", [
    ("0.16.3+cu121", "0.16.3", gating.APPLIES),     # a local build of a release: its source decides
    ("0.16.4+g1234", "0.16.3", gating.APPLIES),     # git build after 0.16.3 (version.txt bumped), before the fix
    ("0.16.4+g5678", "0.16.4", gating.FIXED_UPSTREAM),  # git build with the fix
    ("0.16.4.dev0", "0.16.4", gating.FIXED_UPSTREAM),
    ("0.16.3.post1", "0.16.3", gating.APPLIES),
    ("0.16.3.post1", "0.16.4", gating.FIXED_UPSTREAM),  # says 0.16.3, has upstream's fix backported
    ("0.16.4+g9999", "drifted-0.16.3", gating.DRIFTED),  # neither a known affected source nor the fix
])
def test_module_id_builds_that_are_not_plain_releases_are_judged_by_their_source(version, files, expected,
                                                                                   tmp_path):
    locate = extract_modules("deepspeed", files.rpartition("-")[2], MODULE_ID.modules, str(tmp_path))
    if files.startswith("drifted-"):  # a local change to one of the functions the patch rebuilds
        path = locate(MODULE_ID.targets[0].module)
        text = open(path).read().replace("        my_count = count[0]\n", "        my_count = count[0] + 0\n")
        open(path, "w").write(text)
    found = gating.evaluate(MODULE_ID, version=version, locate=locate)
    verdict, reason = found.verdict, found.reason
    assert verdict == expected, reason


def _functions_touching(tree, attribute):
    """{qualname} of the functions (innermost def) whose code reads or writes `.<attribute>`."""
    found = set()

    def visit(node, names):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, names + [child.name])
            else:
                if isinstance(child, ast.Attribute) and child.attr == attribute:
                    found.add(".".join(names))
                visit(child, names)

    visit(tree, [])
    return found


@pytest.mark.unit_only  # released sources only: once, in the unit session
@pytest.mark.parametrize("pid", [pid for pid, p in registry.all_patches().items() if p.renamed])
def test_a_rename_covers_every_function_that_touches_the_attribute(pid):
    """Over the whole package of every affected release: no function outside the targets reads or writes the
    renamed attribute (except those declared unrelated, each with its reason)."""
    patch = registry.all_patches()[pid]
    attribute, exempt = patch.renamed
    top = patch.modules[0].split(".")[0]
    targets = {f"{t.module.replace('.', '/')}.py:{t.qualname}" for t in patch.targets}
    for version in release_versions(patch.distribution, "0.0", "999"):
        if not SpecifierSet(patch.affected).contains(version) or not (
                not patch.supported or SpecifierSet(patch.supported).contains(version)):
            continue
        touching = _touching(sdist(patch.distribution, version), top, attribute)
        assert touching - set(exempt) == targets, (version, sorted(touching ^ (targets | set(exempt))))


def _touching(archive, top, attribute):
    """{"path:qualname"} of the functions of the release's package that touch `.<attribute>`: read from the sdist
    once per machine (~3 s a release), then from the release cache, keyed by the sdist and by this code."""
    import hashlib
    import inspect
    import json

    from upstream_releases import CACHE, _store

    code = inspect.getsource(_touching) + inspect.getsource(_functions_touching)
    key = hashlib.sha256(f"{os.path.basename(archive)} {os.path.getsize(archive)} {top} {attribute} {code}".encode())
    path = os.path.join(CACHE, "analysis", key.hexdigest()[:24] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return set(json.load(f))
    touching = set()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            relative = member.name.split("/", 1)[-1]
            if not (member.isfile() and relative.startswith(top + "/") and relative.endswith(".py")):
                continue
            with tar.extractfile(member) as f:
                try:
                    tree = ast.parse(f.read())
                except SyntaxError:
                    continue
            touching |= {f"{relative}:{q}" for q in _functions_touching(tree, attribute)}
    _store(path, json.dumps(sorted(touching)).encode())
    return touching
