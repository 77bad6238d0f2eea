"""The proofs every patch owes (see test_proofs.py), the upstream diff's: applied to a copy of the installed
package, with no monkeypatch, it fixes every reproducer, running that copy's files. (Split from test_proofs.py so
that pytest-xdist's workers share the proofs: --dist loadfile keeps one file on one worker.)"""
import os

import pytest

from dspatch import registry
from dspatch import upstream

from conftest import clean_env, nothing_to_prove, verify
from test_proofs import APPLICABLE, _ids

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("pid", _ids(APPLICABLE))
def test_the_upstream_diff_fixes_a_copy_without_dspatch(pid, package_copy):
    from conftest import apply_upstream_diff

    if pid == "none-applies-here":
        nothing_to_prove()
    patch = registry.all_patches()[pid]
    site, package = package_copy(patch.modules[0].split(".")[0])
    apply_upstream_diff(patch, upstream.installed_version(patch.distribution), site)
    outcome = verify(pid, clean_env(PYTHONPATH=site))
    assert outcome["applied"] == [] and outcome["results"] == dict.fromkeys(patch.scenarios, "ok"), outcome
    assert all(path.startswith(package + os.sep) for path in outcome["files"].values()), outcome["files"]
