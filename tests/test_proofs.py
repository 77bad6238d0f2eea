"""The proofs every patch owes, run for every patch in the registry that applies to this stack's releases:

- stock failures are pinned: each reproducer listed in `expected_on_stock` fails on stock with exactly the
  failure declared there (BugSeen carrying that fragment), not with any error;
- the monkeypatch fixes it: with DSPATCH naming the patch, it applies at import (one "applied" line) and every
  reproducer passes; the upstream diff fixes it: applied to a copy of the installed package, with no monkeypatch,
  every reproducer passes, running that copy's files (test_proofs_fixes.py, test_proofs_diffs.py; the diffs of bands
  no stack installs, on a real release of each: test_proofs_bands.py);
- every target is necessary: with the patch applied less any one target, at least one reproducer fails;
- every target's drift is caught: change any one target's source in a copy of the installed package, and
  the running process reports that target "drifted" and changes nothing;
- `python -m dspatch.explain` names the patch from the log of that same stock run (upstream's own traceback,
  with dspatch's BugSeen lines taken out), and from the same log made noisy as real jobs make it.

A patch that does not apply to this stack (fixed upstream, not affected) is covered by its own tests.
"""
import functools
import json
import os
import shutil

import pytest

from dspatch import gating, registry
from dspatch import upstream
from dspatch.versions import SpecifierSet, Version

from conftest import clean_env, nothing_to_prove, run_python, verify, verify_log

pytestmark = pytest.mark.stack

APPLICABLE = [pid for pid, patch in registry.all_patches().items() if gating.evaluate(patch).verdict == gating.APPLIES]


def _ids(values):
    return values or ["none-applies-here"]


@functools.lru_cache(maxsize=None)
def _session_pins():
    """The session's pins as dspatch audit reads them, once for every patch's check."""
    from dspatch import audit

    return audit.read_pins(pins_text=" ".join(json.loads(os.environ["DSPATCH_PINS"])))


@pytest.mark.parametrize("pid", sorted(registry.all_patches()))
def test_what_applies_here_is_what_the_sessions_pins_have(pid):
    """A session proves what its pins have, derived rather than listed by hand (issue 51): each patch applies to the
    installed releases exactly where `dspatch audit` (the verdicts of the released sources, dspatch/audit) gives
    "applies" for the pins the noxfile installed here (DSPATCH_PINS), so that a changed pin or a verdict gone wrong
    cannot quietly take a patch's proofs out of a session, or put them in."""
    if not os.environ.get("DSPATCH_PINS"):
        pytest.skip("not a nox session: DSPATCH_PINS names the session's pins")
    from dspatch import audit

    patch = registry.all_patches()[pid]
    pinned = _session_pins()
    pin = pinned.get(audit.canonical(patch.distribution))
    expected = audit.decide(patch, pin.releases()[0], pinned)[0] if pin else "not pinned"
    here = gating.evaluate(patch)
    assert (here.verdict == gating.APPLIES) == (expected == gating.APPLIES), (here.verdict, here.reason, expected)
    # a patch that names this session in its Proof (proven_in) must apply to its pins
    assert here.verdict == gating.APPLIES or os.environ.get("DSPATCH_TEST_STACK") not in patch.proven_in, \
        f"{pid} names this session in its Proof (proven_in), but does not apply to its pins: {here.reason}"


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_stock_fails_exactly_as_declared(pid):
    if pid == "none-applies-here":
        nothing_to_prove()
    patch = registry.all_patches()[pid]
    results = verify(pid, clean_env())["results"]
    for name, fragment in patch.expected_on_stock.items():
        assert results[name].startswith("bug:") and fragment in results[name], \
            f"stock upstream no longer shows {pid}'s {name} as declared ({fragment!r}): {results[name]}"


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
        nothing_to_prove()
    patch = registry.all_patches()[pid]
    if patch.silent and not (patch.loud_on and SpecifierSet(patch.loud_on).contains(
            Version(upstream.installed_version(patch.distribution)).base_version)):
        # its bug writes nothing a log would show (wrong values, silently): explain cannot name it (here)
        assert patch.loud_on or not patch.signatures
        pytest.skip(f"{pid}: {patch.silent}")
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
        assert found["do"].startswith(f"set DSPATCH={pid} (or DSPATCH=1)"), found["do"]


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_every_target_is_necessary(pid):
    if pid == "none-applies-here":
        nothing_to_prove()
    patch = registry.all_patches()[pid]
    # a patch whose own test proves more, in a process it shares with other checks (CI time): each target left out
    # fails the very reproducer that target is for, with the bug's own message
    if patch.necessity_proven_by:
        pytest.skip(f"{pid}: proven target by target in {patch.necessity_proven_by}")
    out = run_python(["-m", "dspatch.verify", pid, "--leave-out-each"], warm="stack").stdout.strip().splitlines()[-1]
    left_out = json.loads(out)["left_out"]
    assert set(left_out) == {t.qualname for t in patch.targets}
    for target, results in left_out.items():  # applied less that target, and scenarios ran (until one failed)
        assert results and set(results) <= set(patch.scenarios), (target, results)
    unneeded = [target for target, results in left_out.items() if all(r == "ok" for r in results.values())]
    assert not unneeded, f"{pid}: leaving out {unneeded} fails no reproducer (a target nothing proves, or a " \
                         f"reproducer missing): {left_out}"


# One process for every patch that applies (CI time: the copies are imported once, not once per patch): each
# target of each patch is changed in turn in the copy, on disk, while its module is imported from it; then every
# patch is applied to the unchanged copy.
DRIFT_EACH = r'''
import importlib, json, os, sys
import dspatch
from dspatch import gating, registry
from dspatch import upstream
patches = [registry.all_patches()[pid] for pid in sys.argv[2:]]
for module in sorted({m for patch in patches for m in patch.modules}):
    importlib.import_module(module)
assert all(sys.modules[m].__file__.startswith(sys.argv[1]) for p in patches for m in p.modules), "not the copy"
report = {}
for patch in patches:
    report[patch.id] = {}
    for target in patch.targets:
        path = sys.modules[target.module].__file__
        original = open(path).read()
        node = upstream.definition(path, target.qualname)
        first = node.body[0]
        lines = original.split("\n")
        indent = lines[first.lineno - 1][:first.col_offset]
        lines.insert(first.lineno - 1, indent + "_local_change = None  # a fork's one-line change")
        open(path, "w").write("\n".join(lines))
        os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
        try:
            verdict, reason = dspatch.apply([patch.id])[patch.id]
            report[patch.id][target.qualname] = [verdict, str(target) in reason, dspatch._runtime.applied_ids()]
        finally:
            open(path, "w").write(original)
            os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 2 * 10**9))
for patch in patches:  # each alone, as the single-patch check was: reverted before the next
    verdict = dspatch.apply([patch.id])[patch.id][0]
    report[patch.id]["unchanged copy"] = [verdict, dspatch._runtime.applied_ids()]
    dspatch.revert([patch.id], force=True)
print("R " + json.dumps(report))
'''


@pytest.fixture(scope="module")
def drift_report(tmp_path_factory):
    """{pid: {target: [verdict, reason names it, applied ids], "unchanged copy": [verdict, applied ids]}} for every
    patch that applies here, from one process running copies of the installed packages."""
    if not APPLICABLE:
        return {}
    site = tmp_path_factory.mktemp("drift")
    tops = sorted({m.split(".")[0] for pid in APPLICABLE for m in registry.all_patches()[pid].modules})
    for top in tops:
        shutil.copytree(os.path.dirname(upstream.module_file(top)), site / top)  # bytecode too (conftest.package_copy)
    proc = run_python(["-c", DRIFT_EACH, str(site), *APPLICABLE], env=clean_env(PYTHONPATH=str(site)), warm="stack")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_every_targets_drift_is_caught_in_the_running_process(pid, drift_report):
    if pid == "none-applies-here":
        nothing_to_prove()
    patch = registry.all_patches()[pid]
    report = drift_report[pid]
    for target in patch.targets:
        assert report[target.qualname] == [gating.DRIFTED, True, []], (target, report[target.qualname])
    assert report["unchanged copy"] == [gating.APPLIED, [pid]]
