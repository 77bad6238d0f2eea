"""The proofs every patch owes, run for every patch in the registry that applies to this stack's releases:

- stock failures are pinned: each reproducer listed in `expected_on_stock` fails on stock with exactly the
  failure declared there (BugSeen carrying that fragment), not with any error;
- the monkeypatch fixes it: with DSPATCH naming the patch, it applies at import (one "applied" line) and every
  reproducer passes;
- the upstream diff fixes it: applied to a copy of the installed package, with no monkeypatch, every reproducer
  passes, running that copy's files;
- every target is necessary: with the patch applied less any one target, at least one reproducer fails;
- every target's drift is caught: change any one target's source in a copy of the installed package, and
  the running process reports that target "drifted" and changes nothing;
- `python -m dspatch.explain` names the patch from the log of that same stock run (upstream's own traceback,
  with dspatch's BugSeen lines taken out), and from the same log made noisy as real jobs make it.

A patch that does not apply to this stack (fixed upstream, not affected) is covered by its own tests.
"""
import json
import os
import shutil

import pytest

from dspatch import gating, registry

from conftest import clean_env, run_python, verify, verify_log

pytestmark = pytest.mark.stack

APPLICABLE = [pid for pid, patch in registry.all_patches().items() if gating.evaluate(patch)[1] == gating.APPLIES]


def _ids(values):
    return values or ["none-applies-here"]


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_stock_fails_exactly_as_declared(pid):
    if pid == "none-applies-here":
        pytest.skip("no patch applies to this stack")
    patch = registry.all_patches()[pid]
    results = verify(pid, clean_env())["results"]
    for name, fragment in patch.expected_on_stock.items():
        assert results[name].startswith("bug:") and fragment in results[name], \
            f"stock upstream no longer shows {pid}'s {name} as declared ({fragment!r}): {results[name]}"


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_the_monkeypatch_fixes_every_reproducer(pid):
    if pid == "none-applies-here":
        pytest.skip("no patch applies to this stack")
    patch = registry.all_patches()[pid]
    # in a run that imports every target itself (dspatch.pth at start, the hook at import), as a user's job
    proc = run_python(["-m", "dspatch.verify", pid], env=clean_env(DSPATCH=pid), warm="base")
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["applied"] == [pid] and outcome["results"] == dict.fromkeys(patch.scenarios, "ok"), outcome
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    version = gating.installed_version(patch.distribution)
    # one line per process (a reproducer that launches ranks adds its job's local rank 0); a reproducer may apply
    # another patch to get past that other bug: only "applied" lines, then
    ours = [line for line in said if pid in line]
    assert ours and set(ours) == {f"dspatch: applied {pid} ({patch.distribution} {version})"}, said
    assert all(line.startswith("dspatch: applied ") for line in said), said


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_the_upstream_diff_fixes_a_copy_without_dspatch(pid, package_copy):
    from conftest import apply_upstream_diff

    if pid == "none-applies-here":
        pytest.skip("no patch applies to this stack")
    patch = registry.all_patches()[pid]
    site, package = package_copy(patch.modules[0].split(".")[0])
    apply_upstream_diff(patch, gating.installed_version(patch.distribution), site)
    outcome = verify(pid, clean_env(PYTHONPATH=site))
    assert outcome["applied"] == [] and outcome["results"] == dict.fromkeys(patch.scenarios, "ok"), outcome
    assert all(path.startswith(package + os.sep) for path in outcome["files"].values()), outcome["files"]


# patches whose bug writes nothing a log would show (wrong values, silently): explain cannot name them
SILENT = {"deepspeed/initialize-once": "a second initialize goes through without a word; what breaks later varies",
          "deepspeed/engine-releases-model": "memory held, no message: proven by what gc.collect() frees",
          "transformers/deepspeed-grad-accum-scale": "gradients GA times too small, no message: proven by numbers",
          "deepspeed/zero3-gather-waits-all": "weights read before they arrive, no message: proven by their values"}


def _upstream_log(pid):
    """The stock run's stderr less dspatch's own words (BugSeen lines), so only upstream's text can match."""
    return "\n".join(line for line in verify_log(pid, clean_env()).splitlines()
                     if "BugSeen" not in line and not line.startswith("dspatch.verify:"))


def _noisy(log):
    """The same log as a 2-rank job writes it: rank prefixes, interleaved with another rank's progress bars
    (carriage-return redraws), ANSI colour on every line, and lines cut at 300 characters."""
    out = []
    for number, line in enumerate(log.splitlines()):
        out.append(f"\x1b[31m[rank1]:\x1b[0m {line}"[:300])
        if number % 3 == 0:
            out.append(f"[rank0]: \x1b[32m 10%|#         | {number}/100 [00:01<00:09]\r 11%|#  | {number + 1}/100\x1b[0m")
    return "\n".join(out)


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_explain_names_the_bug_from_the_stock_traceback(pid):
    if pid == "none-applies-here":
        pytest.skip("no patch applies to this stack")
    patch = registry.all_patches()[pid]
    if pid in SILENT:
        assert not patch.signatures
        pytest.skip(f"{pid}: {SILENT[pid]}")
    assert patch.signatures, f"{pid} declares no log signature for dspatch.explain"
    log = _upstream_log(pid)
    for text in (log, _noisy(log)):
        proc = run_python(["-m", "dspatch.explain", "--json", "-"], env=clean_env(), check=False, input=text)
        assert proc.returncode == 0, (proc.stdout, proc.stderr, log[-3000:])
        report = json.loads(proc.stdout)
        named = {bug["id"]: bug for bug in report["bugs"]}
        # where another bug gives the same message and this log cannot tell them apart (a module.id deque on
        # 0.15.4-0.16.3), the bug is offered among the candidates, never a wrong one named instead
        offered = {c["id"]: c for choice in report["undecided"] for c in choice["candidates"] if pid in choice["ids"]}
        assert not named.keys() - {pid}, (named, log[-3000:])
        found = named.get(pid) or offered.get(pid)
        assert found and found["verdict"] == gating.APPLIES, (report, log[-3000:])
        assert found["do"].startswith("set DSPATCH=1")


# patches whose own test proves more, in a process it shares with other checks (CI time): each target left out
# fails the very reproducer that target is for, with the bug's own message
NECESSITY_PROVEN_BY = {"deepspeed/checkpoint-weights-only":
                       "test_checkpoint_weights_only.py::test_patched_stock_and_each_target_left_out_in_one_process"}


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_every_target_is_necessary(pid):
    if pid == "none-applies-here":
        pytest.skip("no patch applies to this stack")
    if pid in NECESSITY_PROVEN_BY:
        pytest.skip(f"{pid}: proven target by target in {NECESSITY_PROVEN_BY[pid]}")
    patch = registry.all_patches()[pid]
    out = run_python(["-m", "dspatch.verify", pid, "--leave-out-each"], warm="stack").stdout.strip().splitlines()[-1]
    left_out = json.loads(out)["left_out"]
    assert set(left_out) == {t.qualname for t in patch.targets}
    for target, results in left_out.items():  # applied less that target, and scenarios ran (until one failed)
        assert results and set(results) <= set(patch.scenarios), (target, results)
    unneeded = [target for target, results in left_out.items() if all(r == "ok" for r in results.values())]
    assert not unneeded, f"{pid}: leaving out {unneeded} fails no reproducer (a target nothing proves, or a " \
                         f"reproducer missing): {left_out}"


DRIFT_EACH = r'''
import importlib, json, os, sys
import dspatch
from dspatch import gating, registry
patch = registry.all_patches()[sys.argv[1]]
for module in patch.modules:
    importlib.import_module(module)
assert all(sys.modules[m].__file__.startswith(sys.argv[2]) for m in patch.modules), "not the copy"
report = {}
for target in patch.targets:
    path = sys.modules[target.module].__file__
    original = open(path).read()
    node = gating.definition(path, target.qualname)
    first = node.body[0]
    lines = original.split("\n")
    indent = lines[first.lineno - 1][:first.col_offset]
    lines.insert(first.lineno - 1, indent + "_local_change = None  # a fork's one-line change")
    open(path, "w").write("\n".join(lines))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    try:
        verdict, reason = dspatch.apply([patch.id])[patch.id]
        report[target.qualname] = [verdict, str(target) in reason, dspatch._runtime.applied_ids()]
    finally:
        open(path, "w").write(original)
        os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 2 * 10**9))
report["unchanged copy"] = list(dspatch.apply([patch.id])[patch.id][:1]) + [dspatch._runtime.applied_ids()]
print("R " + json.dumps(report))
'''


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_every_targets_drift_is_caught_in_the_running_process(pid, tmp_path):
    if pid == "none-applies-here":
        pytest.skip("no patch applies to this stack")
    patch = registry.all_patches()[pid]
    top = patch.modules[0].split(".")[0]
    source = os.path.dirname(gating.module_file(top))
    shutil.copytree(source, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    proc = run_python(["-c", DRIFT_EACH, pid, str(tmp_path / top)], env=clean_env(PYTHONPATH=str(tmp_path)), warm="stack")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    for target in patch.targets:
        assert report[target.qualname] == [gating.DRIFTED, True, []], (target, report[target.qualname])
    assert report["unchanged copy"] == [gating.APPLIED, [pid]]


def _matrix_versions(distribution):
    """Versions of `distribution` some stack of the matrix installs (noxfile passes DSPATCH_MATRIX)."""
    stacks = json.loads(os.environ.get("DSPATCH_MATRIX", "{}"))
    found = {pin.split("==")[1] for pins in stacks.values() for pin in pins if pin.startswith(distribution + "==")}
    return sorted(found)


def _target_code(patch, version, into):
    """The fingerprints of a release's targets (its code, as the gate sees it), from its sdist."""
    from upstream_releases import extract_modules

    locate = extract_modules(patch.distribution, version, patch.modules, os.path.join(into, version))
    return tuple(gating.fingerprint(locate(t.module), t.qualname) if locate(t.module) else None
                 for t in patch.targets)


def _bands_no_stack_runs():
    """(pid, band, release, reason to skip or None) for the diff bands that no stack of the matrix installs.
    A band runs on the released source of its newest release, with the rest of the old stack, unless the code
    of its targets is that of a release a stack runs, or of a band already run here (then only the diff's
    context differs, which the unit session checks with `git apply --check` on every release)."""
    import tempfile

    from packaging.specifiers import SpecifierSet

    from upstream_releases import sdist_versions

    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for pid in APPLICABLE:
            patch = registry.all_patches()[pid]
            releases = sdist_versions(patch.distribution, "0.0", "999")
            covered = [v for v in releases if v in _matrix_versions(patch.distribution)]  # same order on every worker
            seen = {}
            for v in covered:
                seen.setdefault(_target_code(patch, v, tmp), f"{patch.distribution} {v}, which a stack runs")
            for band in patch.diffs:
                in_band = [v for v in releases if SpecifierSet(band).contains(v)]
                if not in_band or any(SpecifierSet(band).contains(v) for v in covered):
                    continue
                code = _target_code(patch, in_band[-1], tmp)
                found.append((pid, band, in_band[-1], seen.get(code)))
                seen.setdefault(code, f"{patch.distribution} {in_band[-1]}, run for band {band}")
    return found


BANDS = _bands_no_stack_runs() if os.environ.get("DSPATCH_TEST_STACK") == "old" else []


@pytest.mark.parametrize("pid, band, version, same_code", BANDS or [("none", "", "", None)])
def test_diff_bands_no_stack_installs_fix_a_real_release_of_the_band(pid, band, version, same_code, tmp_path):
    """Stock shows the bug on that release's own source (the patch's `band_check` reproducer), and the band's
    diff applied to it fixes it."""
    import subprocess
    import tarfile

    from dspatch import data_dir

    from upstream_releases import sdist

    if pid == "none":
        pytest.skip("run on the old stack only (the oldest dependencies of the matrix)")
    if same_code:
        pytest.skip(f"{version}'s targets are the code of {same_code}: only the diff's context differs "
                    f"(`git apply --check` on every release of the band, unit session)")
    patch = registry.all_patches()[pid]
    top = patch.modules[0].split(".")[0]
    with tarfile.open(sdist(patch.distribution, version)) as tar:
        # the package, at the top of the sdist or under src/ (accelerate, transformers); the diffs use the same paths
        members = [m for m in tar.getmembers() if m.name.split("/", 1)[-1].split("/")[0] == top
                   or m.name.split("/", 1)[-1].startswith(f"src/{top}/")]
        tar.extractall(tmp_path, members=members, filter="tar")
    root = next(tmp_path.iterdir())
    site = root / "src" if (root / "src" / top).is_dir() else root
    probe = run_python(["-c", f"import {top}"], env=clean_env(PYTHONPATH=str(site)), check=False)
    if probe.returncode:  # said in the skip reason: that band is proven by fingerprint and `git apply` only
        pytest.skip(f"{patch.distribution} {version} cannot be imported with this stack's torch: "
                    f"{probe.stderr.strip().splitlines()[-1][:200]}")
    name = patch.band_check
    stock = verify(pid, clean_env(PYTHONPATH=str(site)), "--only", name)
    if "torch._C' has no attribute '_cuda" in stock["results"][name]:  # accelerate < 0.25 with DeepSpeed
        pytest.skip(f"{patch.distribution} {version} runs this reproducer on CUDA only (this torch is a CPU "
                    f"build): that band is proven by fingerprint and `git apply` only")
    assert patch.expected_on_stock[name] in stock["results"][name], (version, name, stock["results"][name])
    subprocess.run(["git", "apply", os.path.join(data_dir("upstream_prs"), patch.diffs[band])], cwd=root, check=True)
    fixed = verify(pid, clean_env(PYTHONPATH=str(site)), "--only", name)
    assert fixed["applied"] == [] and fixed["results"] == {name: "ok"}, (version, fixed)
