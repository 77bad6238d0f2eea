"""Test helpers. Tests marked `stack` need a real upstream stack (nox sessions old/mid/latest set
DSPATCH_TEST_STACK; there a missing package is a failure, not a skip). Tests marked `unit_only` run once,
in the torch-free unit session."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from warm import close_all as _close_zygotes, run as warm_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACK = os.environ.get("DSPATCH_TEST_STACK")


# dspatch's own machinery (the import hook, strict mode, other patchers' wrappers, launchers, the warm test
# interpreters): what these tests prove does not depend on the upstream release, so they run on the stacks named
# here, not on all four (CI time). What does depend on the release, every patch's proofs, the no-harm matrix and
# bit-identity with every patch active, runs on every stack.
MACHINERY_STACKS = ("mid",)  # deepspeed/zero3-module-id, which the machinery tests patch, applies there


# The heaviest files first (seconds on 2 cores, old and mid sessions): --dist loadfile hands whole files to the
# workers in this order, so the long ones start at once and the short ones fill in at the end.
HEAVY_FIRST = ("test_proofs_fixes.py", "test_proofs_diffs.py", "test_proofs_bands.py", "test_proofs.py",
               "test_activation.py", "test_checkpoint_weights_only.py", "test_ppo_deepspeed_save.py", "test_warm.py",
               "test_torchrun.py", "test_coexistence.py", "test_launchers.py", "test_zero3_generation_hooks.py",
               "test_peft_zero3_save.py", "test_deepspeed_no_sync.py")


# A session outside the matrix proves the patches whose Proof names it (proven_in; own_tests_in: their own tests only)
# and no others: the tests of any other patch, and dspatch's own, are deselected. Ids from the declarations, not -k
# substrings: a substring can miss a test or catch another patch's (a6fee7b).
OUTSIDE_MATRIX = STACK is not None and STACK not in json.loads(os.environ.get("DSPATCH_MATRIX") or "{}")


def proven_here():
    """(ids whose proofs and own tests run here, ids whose own tests only), for a session outside the matrix."""
    from dspatch import registry

    patches = registry.all_patches().values()
    return [p.id for p in patches if STACK in p.proven_in], [p.id for p in patches if STACK in p.own_tests_in]


def pytest_collection_modifyitems(config, items):
    if OUTSIDE_MATRIX:
        prove, own_tests = proven_here()
        if not prove + own_tests:
            raise pytest.UsageError(f"no patch names the session {STACK!r} in its Proof (proven_in, own_tests_in)")
        kept, others = [], []
        for item in items:
            pid = _patch_of(item)
            here = pid in prove or _proves_nothing(item) or (pid in own_tests and str(item.fspath).startswith(PATCHES_DIR))
            (kept if here else others).append(item)
        config.hook.pytest_deselected(items=others)
        items[:] = kept
    rank = {name: number for number, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable: files stay whole
    for item in items:
        item.user_properties.append(("dspatch_patch", _patch_of(item)))
        marker = item.get_closest_marker("machinery")
        stacks = (marker.args or MACHINERY_STACKS) if marker else None
        if marker and STACK and STACK not in stacks:
            item.add_marker(pytest.mark.skip(reason=f"dspatch's own machinery, release-independent: proven on the "
                                                    f"{' and '.join(stacks)} stack{'s' * (len(stacks) > 1)}"))
    if STACK or importlib.util.find_spec("deepspeed") is not None:
        return
    skip = pytest.mark.skip(reason="needs a real upstream stack: run `nox -s old`, `mid` or `latest`")
    for item in items:
        if "stack" in item.keywords and "unit_only" not in item.keywords:  # a patch's release-source checks run here
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _stack_is_complete():
    if STACK:
        for name in ("torch", "deepspeed"):
            assert importlib.util.find_spec(name), f"stack session {STACK!r} lacks {name}"
    yield
    _close_zygotes()


# The environment the test run started with: what an in-process reproducer sets (rendezvous variables, a free
# MASTER_PORT) must neither leak into later subprocesses nor defeat the memo of verify() below.
_START_ENV = dict(os.environ)


def nothing_to_prove():
    """Where no patch applies to a stack session's releases, a proof fails instead of passing by skipping (issue 51):
    a stack session exists to prove patches, and one that proves none has lost them (a pin or a verdict changed)."""
    pytest.fail(f"no patch applies to this stack ({os.environ.get('DSPATCH_TEST_STACK') or 'unnamed'}): a stack "
                "session that proves nothing has lost its patches (a changed pin, or a verdict gone wrong)")


def clean_env(**extra):
    """The test run's starting environment without any DSPATCH* variable, plus `extra`."""
    # (xdist's differ per worker; the terminal's width and colour settings are each test's own to give)
    env = {k: v for k, v in _START_ENV.items() if not k.startswith(("DSPATCH", "PYTEST_"))
           and k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


GATHER_FIX = "deepspeed/zero3-gather-waits-all"


def with_gather_fix(pid):
    """`pid`, and deepspeed/zero3-gather-waits-all where it applies: ranks on the CPU (gloo) gather several ZeRO-3
    parameters at once reliably only with it (deepspeed < 0.19.8), as DSPATCH=1 gives them. For multi-rank jobs
    whose patch gathers several parameters at once."""
    from dspatch import gating, registry

    return [pid] + ([GATHER_FIX] if gating.evaluate(registry.all_patches()[GATHER_FIX]).verdict == gating.APPLIES else [])


def run_python(args, env=None, check=True, timeout=900, cwd=None, input=None, warm=False):
    """Run this interpreter in a neutral directory, so that it uses dspatch as installed, not the checkout.

    `warm`: from a zygote (tests/warm.py) that imported, once, "stack": the stack (for runs whose result is their
    own output: what the stack printed while importing, dspatch's "applied" line included, is not in it), or
    "base": torch and nothing dspatch watches (the run imports every target itself, as a fresh one does)."""
    env = clean_env() if env is None else env
    cwd = cwd or tempfile.gettempdir()
    proc = warm_run(args, env, cwd, input, timeout, warm) if warm and STACK else None
    if proc is None:
        proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, input=input)
    if check:
        _succeeded(args, proc)
    return proc


def _succeeded(args, proc):
    if proc.returncode != 0:
        raise AssertionError(f"python {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")


def last_json(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


def skip_unless_applies(*pids):
    """Skip the calling test (a module's fixture: its tests) where one of `pids` does not apply to this stack, with
    the gate's reason: a patch's own tests run where its fix is installed."""
    from dspatch import gating, registry

    for pid in pids:
        found = gating.evaluate(registry.all_patches()[pid])
        if found.verdict != gating.APPLIES:
            pytest.skip(f"{pid} does not apply to this stack: {found.reason}")


def stock_and_patched(pids, script, patched_env, patched="patched"):
    """{"stock": ..., `patched`: ...}: the last JSON line `script` prints, run on stock and with `patched_env`
    (DSPATCH=1, or one id), in the warm stack process; the test module is skipped where one of `pids` does not
    apply. The own tests of the silent gradient bugs compare the two."""
    skip_unless_applies(*pids)
    return {mode: last_json(run_python(["-c", script], env=clean_env(**env), warm="stack"))
            for mode, env in (("stock", {}), (patched, patched_env))}


_verified = {}


def verify(patch_id, env, *extra):
    """Run a patch's reproducers in a fresh interpreter: {"applied": [...], "results": {...}}. The same run on
    the installed stack asked for twice in a session (a patch's own test and the shared proofs) runs once."""
    if "PYTHONPATH" in env:  # a copy of upstream, which the test may change between runs: always run
        return last_json(run_python(["-m", "dspatch.verify", patch_id, *extra], env=env, warm="stack"))
    return json.loads(json.dumps(_verify_run(patch_id, env, *extra)[0]))  # a copy: callers may change it


def verify_patched(patch_id):
    """(JSON, stderr) of the monkeypatch's proof run: dspatch.verify with DSPATCH naming the patch, in a run that
    imports every target itself (dspatch.pth at start, the hook at import), as a user's job. Once per session:
    test_proofs_fixes.py and a patch's own tests read the same run."""
    return _verify_run(patch_id, clean_env(DSPATCH=patch_id), warm="base")


def _verify_run(patch_id, env, *extra, warm="stack"):
    key = (patch_id, tuple(sorted(env.items())), extra, warm)
    if key not in _verified:
        _verified[key] = _shared_between_workers(key, lambda: run_python(["-m", "dspatch.verify", patch_id, *extra],
                                                                         env=env, warm=warm))
    return _verified[key]


def _shared_between_workers(key, run):
    """(result JSON, stderr) of `run`, computed once per test run even across pytest-xdist workers: a patch's own
    tests and test_proofs.py often land on different workers and ask for the same stock run. The first worker
    runs it under a file lock; the others wait for it and read its result."""
    import fcntl
    import hashlib

    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        proc = run()
        return last_json(proc), proc.stderr
    folder = os.path.join(tempfile.gettempdir(), f"dspatch-verify-{run_id}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, hashlib.sha256(repr(key).encode()).hexdigest()[:24])
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path + ".json"):
            with open(path + ".json") as f:
                return tuple(json.load(f))
        proc = run()
        result = (last_json(proc), proc.stderr)
        with open(path + ".json.part", "w") as f:
            json.dump(result, f)
        os.replace(path + ".json.part", path + ".json")
        return result


def verify_log(patch_id, env, *extra):
    """What the same (memoised) verify run wrote to stderr: the tracebacks of the bugs it saw."""
    return _verify_run(patch_id, env, *extra)[1]


def deepspeed_version():
    from dspatch.gating import installed_version

    return installed_version("deepspeed")


@pytest.fixture
def deepspeed_copy(tmp_path):
    """A private copy of the installed deepspeed package: (directory for PYTHONPATH, package dir)."""
    from dspatch.gating import module_file

    source = os.path.dirname(module_file("deepspeed"))
    site = tmp_path / "site"
    shutil.copytree(source, site / "deepspeed")  # bytecode too: see package_copy
    return str(site), str(site / "deepspeed")


@pytest.fixture
def package_copy(tmp_path):
    """A factory: package_copy("transformers") copies that installed top-level package into a private site
    directory and returns (directory for PYTHONPATH, package dir). Call it once per package the diff touches,
    all land in the same site directory.

    The copy keeps the installed bytecode (__pycache__, with the sources' times: copytree copies them), so that a run
    compiles only the files a test changed (Python checks each cached file against its source's time and size):
    4.5 s less per import of deepspeed on 2 cores."""
    from dspatch.gating import module_file

    site = tmp_path / "site"

    def copy(package):
        source = os.path.dirname(module_file(package))
        shutil.copytree(source, site / package)
        return str(site), str(site / package)

    return copy


def apply_upstream_diff(patch, version, tree):
    """`git apply --check`, then `git apply`, of `patch`'s upstream_prs/ diff for `version` onto `tree` (a copy
    of the installed packages, laid out as site-packages: a diff written against the repository's src/ layout
    is applied with that level stripped). Returns the diff's path."""
    from dspatch import data_dir

    relative = patch.diff_for(version)
    assert relative, f"no upstream diff of {patch.id} covers {version}"
    diff = os.path.join(data_dir("upstream_prs"), relative)
    with open(diff) as f:
        src_layout = "\n--- a/src/" in "\n" + f.read()
    strip = "-p2" if src_layout and not os.path.isdir(os.path.join(tree, "src")) else "-p1"
    subprocess.run(["git", "apply", strip, "--check", diff], cwd=tree, check=True)
    subprocess.run(["git", "apply", strip, diff], cwd=tree, check=True)
    return diff


# torch's gloo backend sometimes aborts a rank from inside C++ under load, with no Python error:
# "terminate called without an active exception" (exit -6), seen in CI on finished ranks and on a rank waiting
# for another. It is not what a multi-process test proves, so such a run is repeated once (from an empty output
# folder); the same abort twice, or any other failure, fails the test.
GLOO_ABORT = "terminate called without an active exception"


def run_ranks(args, env, fresh, check=True, **kwargs):
    """run_python for a multi-process launch whose ranks write into the folder `fresh`."""
    for attempt in (1, 2):
        shutil.rmtree(fresh, ignore_errors=True)
        os.makedirs(fresh)
        proc = run_python(args, env=env, check=False, **kwargs)
        if proc.returncode == 0 or GLOO_ABORT not in proc.stderr or attempt == 2:
            break
        print(f"run_ranks: gloo aborted a rank ({GLOO_ABORT!r}); running the launch once more", file=sys.stderr)
    if check:
        _succeeded(args, proc)
    return proc


# Seconds per patch: every stack session ends with what each patch's proofs cost on that stack (the cost of a
# patch, kept visible as the catalogue grows). A test counts for the patch it names: its `pid` parameter, else the
# patch whose folder it is in, else its module's PID; the rest (runtime, harness, launchers) is "(shared)".
PATCHES_DIR = os.path.join(ROOT, "dspatch", "patches")


def _patch_of(item):
    pid = getattr(getattr(item, "callspec", None), "params", {}).get("pid")
    if pid is None:
        where = os.path.relpath(str(item.fspath), PATCHES_DIR).split(os.sep)
        if len(where) == 3 and where[0] != "..":  # <package>/<name>/test_x.py
            pid = f"{where[0]}/{where[1].replace('_', '-')}"
        else:  # a file of tests/ about one patch names it
            pid = getattr(getattr(item, "module", None), "PID", None)
    return pid if isinstance(pid, str) and "/" in pid else "(shared)"


def _proves_nothing(item):
    """A proof parametrized with no patch at all (nothing applies here): kept, so that it fails (nothing_to_prove)."""
    return getattr(getattr(item, "callspec", None), "params", {}).get("pid") == "none-applies-here"


_seconds = {}


def pytest_runtest_logreport(report):
    pid = dict(report.user_properties).get("dspatch_patch")
    if pid:
        _seconds[pid] = _seconds.get(pid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    total = sum(_seconds.values())
    write = terminalreporter.write_line
    terminalreporter.section(f"seconds per patch ({STACK or 'unit'} session; test time summed over workers)")
    for pid, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        write(f"{seconds:8.1f} s  {100 * seconds / total:5.1f}%  {pid}")
    write(f"{total:8.1f} s  total")
