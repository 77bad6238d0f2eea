"""The proofs every patch owes (see test_proofs.py), the monkeypatch's: with DSPATCH naming the patch, every
reproducer passes in a run that imports every target itself. (The upstream diff's: test_proofs_diffs.py. Split from
test_proofs.py so that pytest-xdist's workers share the proofs: --dist loadfile keeps one file on one worker.)"""
import pytest

from dspatch import registry
from dspatch import upstream

from conftest import nothing_to_prove, verify_patched
from test_proofs import APPLICABLE, _ids

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_the_monkeypatch_fixes_every_reproducer(pid):
    if pid == "none-applies-here":
        nothing_to_prove()
    patch = registry.all_patches()[pid]
    # in a run that imports every target itself (dspatch.pth at start, the hook at import), as a user's job
    outcome, stderr = verify_patched(pid)
    assert outcome["applied"] == [pid] and outcome["results"] == dict.fromkeys(patch.scenarios, "ok"), outcome
    said = [line for line in stderr.splitlines() if line.startswith("dspatch:")]
    version = upstream.installed_version(patch.distribution)
    # one line per process (a reproducer that launches ranks adds its job's local rank 0); a reproducer may apply
    # another patch to get past that other bug: only "applied" lines, then
    ours = [line for line in said if pid in line]
    assert ours and set(ours) == {f"dspatch: applied {pid} ({patch.distribution} {version})"}, said
    assert all(line.startswith("dspatch: applied ") for line in said), said
