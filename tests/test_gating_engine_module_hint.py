"""deepspeed/engine-module-hint against every released deepspeed 0.14.0-0.19.8 (sdists from PyPI, nothing executed):
the bug is open upstream (no fixed release), so the fingerprint of the target's source decides; and every diff
band applies to every release of its band."""
import os
import subprocess

import pytest
from packaging.specifiers import SpecifierSet

from dspatch import data_dir, gating, registry

from upstream_releases import extract_modules, released_fingerprints, sdist_versions

pytestmark = pytest.mark.unit_only

PATCH = registry.all_patches()["deepspeed/engine-module-hint"]
RELEASES = sdist_versions("deepspeed", "0.14.0", "0.19.8")
# the three bands of source of DeepSpeedEngine.__getattr__ (0.14.3 dropped the CompiledModuleWrapper branch,
# 0.19.6 is PR 8288's rewrite); the diffs split the middle band once more where the next method changed (0.17.1)
SOURCE_BANDS = {"b89bab2187e2eef1": ("0.14.0", "0.14.2"), "5d7184bbdf74f73b": ("0.14.3", "0.19.5"),
                "2b4ad7b1b86e791f": ("0.19.6", "0.19.8")}


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.14.0" and RELEASES[-1] == "0.19.8" and len(RELEASES) >= 45
    assert {"0.14.2", "0.14.3", "0.19.5", "0.19.6"} <= set(RELEASES)


def test_the_patch_is_gated_by_source_only():
    assert PATCH.fixed_in is None and PATCH.fixed_marker is None  # open upstream: no release number decides
    assert [(t.module, t.qualname) for t in PATCH.targets] == [("deepspeed.runtime.engine",
                                                                 "DeepSpeedEngine.__getattr__")]


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_and_diff_for_release(version, tmp_path):
    locate = extract_modules("deepspeed", version, PATCH.modules, str(tmp_path))
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    assert verdict == gating.APPLIES, reason
    found = gating.fingerprint(locate(PATCH.targets[0].module), PATCH.targets[0].qualname)
    low, high = SOURCE_BANDS[found]
    assert version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]
    diff = PATCH.diff_for(version)
    assert diff, f"no upstream diff for {version}"
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), diff)], cwd=tmp_path,
                   check=True)


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    """No stale entries, none missing: the accepted fingerprints are exactly those of the released sources."""
    seen = released_fingerprints(PATCH, RELEASES, tmp_path)
    for t in PATCH.targets:
        assert set(t.fingerprints) == seen[t.qualname] == set(SOURCE_BANDS), t


def test_diff_bands_cover_every_release_exactly_once():
    for version in RELEASES:
        assert sum(SpecifierSet(b).contains(version) for b in PATCH.diffs) == 1, version
    for path in PATCH.diffs.values():
        text = open(os.path.join(data_dir("upstream_prs"), path)).read()
        for field in ("Description:", "Bug: https://github.com/deepspeedai/DeepSpeedExamples/issues/924",
                      "Forwarded: no", "Last-Update:", "dspatch-Id: deepspeed/engine-module-hint"):
            assert field in text, (path, field)


def test_the_deepspeedexamples_diff_is_well_formed():
    path = os.path.join(data_dir("upstream_prs"), "DeepSpeedExamples",
                        "0001-deepspeed-chat-print-throughput-engine-module.patch")
    text = open(path).read()
    assert "Bug: https://github.com/deepspeedai/DeepSpeedExamples/issues/924" in text
    assert "commit\n 45b4b7156c8794a3452a5a7d03dbd8d797068569" in text  # the head it was made against
    body = text.split("\n---\n", 1)[1].split("\n-- \n", 1)[0]  # between the stat and the signature
    changed = [line for line in body.splitlines() if line[:1] in ("+", "-") and line[:4] not in ("+++ ", "--- ")]
    assert changed == ["-                print_throughput(model.model, args, end - start,",
                       "+                print_throughput(model.module, args, end - start,"] * 2

def test_versions_outside_the_written_range_and_future_ones(tmp_path):
    def verdict(version, locate=lambda m: None):
        return gating.evaluate(PATCH, version=version, locate=locate)[1]

    assert verdict("0.13.5") == gating.UNSUPPORTED
    latest = extract_modules("deepspeed", "0.19.8", PATCH.modules, str(tmp_path / "latest"))
    # a later release with the same source gets the fix; one whose source changed is left out
    assert verdict("0.20.0", latest) == gating.APPLIES and verdict("0.19.9+g1234", latest) == gating.APPLIES
    path = latest(PATCH.targets[0].module)
    text = open(path).read()
    changed = text.replace("            raise AttributeError(f\"'{type(self).__name__}' object has no attribute "
                           "'{name}'\")", "            raise AttributeError(f\"{type(self).__name__}: no {name}\")")
    assert changed != text
    open(path, "w").write(changed)
    assert verdict("0.20.0", latest) == gating.DRIFTED and verdict("0.19.8", latest) == gating.DRIFTED
