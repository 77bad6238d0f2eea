"""deepspeed/initialize-once against every released deepspeed 0.14.0-0.19.8 (sdists from PyPI, nothing executed):
the bug is open upstream (no fixed release), so the fingerprints of the two targets decide; every diff band
applies to every release of its band, and only there."""
import os
import subprocess

import pytest
from packaging.specifiers import SpecifierSet

from dspatch import data_dir, gating, registry

from upstream_releases import extract_modules, released_fingerprints, sdist_versions

pytestmark = pytest.mark.unit_only

PATCH = registry.all_patches()["deepspeed/initialize-once"]
RELEASES = sdist_versions("deepspeed", "0.14.0", "0.19.8")
# the diffs add deepspeed/runtime/initialize_guard.py and touch these two files
DIFF_FILES = ("deepspeed/__init__.py", "deepspeed/runtime/engine.py")


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.14.0" and RELEASES[-1] == "0.19.8" and len(RELEASES) >= 45


def test_the_patch_is_gated_by_source_only():
    assert PATCH.fixed_in is None and PATCH.fixed_marker is None and PATCH.affected == ">=0"
    assert [(t.module, t.qualname) for t in PATCH.targets] == [
        ("deepspeed", "initialize"), ("deepspeed.runtime.engine", "DeepSpeedEngine.destroy")]


def _release_tree(version, into):
    """The two files the diffs touch, extracted from the sdist under `into` (paths as in the repository)."""
    from upstream_releases import sdist
    import tarfile

    with tarfile.open(sdist("deepspeed", version)) as tar:
        for member in tar.getmembers():
            relative = member.name.split("/", 1)[-1]
            if relative in DIFF_FILES and member.isfile():
                target = os.path.join(into, relative)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    dst.write(src.read())


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_and_diff_for_release(version, tmp_path):
    locate = extract_modules("deepspeed", version, PATCH.modules, str(tmp_path / "mods"))
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    assert verdict == gating.APPLIES, reason
    diff = PATCH.diff_for(version)
    assert diff, f"no upstream diff for {version}"
    tree = tmp_path / "tree"
    _release_tree(version, str(tree))
    for path in PATCH.diffs.values():  # its own band's diff applies; no other band's does
        check = subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), path)], cwd=tree,
                               capture_output=True)
        assert (check.returncode == 0) == (path == diff), (version, path, check.stderr)


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    """No stale entries, none missing: the accepted fingerprints are exactly those of the released sources."""
    seen = released_fingerprints(PATCH, RELEASES, tmp_path)
    for t in PATCH.targets:
        assert set(t.fingerprints) == seen[t.qualname], t


def test_diff_bands_cover_every_release_exactly_once():
    for version in RELEASES:
        assert sum(SpecifierSet(b).contains(version) for b in PATCH.diffs) == 1, version
    for path in PATCH.diffs.values():
        text = open(os.path.join(data_dir("upstream_prs"), path)).read()
        for field in ("Description:", "Bug: https://github.com/deepspeedai/DeepSpeed/issues/6772",
                      "Forwarded: no", "Last-Update: 2026-11-23", "dspatch-Id: deepspeed/initialize-once",
                      "create mode 100644 deepspeed/runtime/initialize_guard.py"):
            assert field in text, (path, field)


def test_versions_outside_the_written_range_and_future_ones(tmp_path):
    def verdict(version, locate=lambda m: None):
        return gating.evaluate(PATCH, version=version, locate=locate)[1]

    assert verdict("0.13.5") == gating.UNSUPPORTED
    latest = extract_modules("deepspeed", "0.19.8", PATCH.modules, str(tmp_path / "latest"))
    # a later release with the same source gets the fix; one whose source changed is left out
    assert verdict("0.20.0", latest) == gating.APPLIES
    path = latest("deepspeed")
    text = open(path).read()
    changed = text.replace('    assert model is not None, "deepspeed.initialize requires a model"\n',
                           '    assert model is not None, "deepspeed.initialize needs a model"\n')
    assert changed != text
    open(path, "w").write(changed)
    assert verdict("0.20.0", latest) == gating.DRIFTED and verdict("0.19.8", latest) == gating.DRIFTED
