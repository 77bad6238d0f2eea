"""deepspeed/frozen-param-names against every released deepspeed 0.14.0-0.19.8 (sdists from PyPI, nothing executed):
the bug is open upstream (no fixed release), so the fingerprints of the three targets' source decide; every
release gets the patch, a later one only while its source is unchanged; every diff band applies to every release
of its band."""
import os
import subprocess

import pytest
from packaging.specifiers import SpecifierSet

from dspatch import data_dir, gating, registry

from upstream_releases import extract_modules, released_fingerprints, sdist_versions

pytestmark = pytest.mark.unit_only

PATCH = registry.all_patches()["deepspeed/frozen-param-names"]
RELEASES = sdist_versions("deepspeed", "0.14.0", "0.19.8")
ENGINE = "deepspeed.runtime.engine"
# the released source of each target, by band (recomputed below from every sdist)
SOURCE_BANDS = {
    "DeepSpeedEngine._get_zero_frozen_param_attributes": {"f8648b2df42741a6": ("0.14.0", "0.19.7"),
                                                          "7601ced6e8d95847": ("0.19.8", "0.19.8")},
    "DeepSpeedEngine._get_zero_param_shapes": {"0bb52408fd2b44fc": ("0.14.0", "0.17.4"),
                                               "a4faa6cfee2f790a": ("0.17.5", "0.19.8")},
    "DeepSpeedEngine.load_module_state_dict": {"1788f30970debe90": ("0.14.0", "0.19.2"),
                                               "16d610a68612a873": ("0.19.3", "0.19.7"),
                                               "a0fe438ee5c1ff72": ("0.19.8", "0.19.8")},
}
# the diffs split where the context of any of the three insertions changed
DIFF_BANDS = {">=0.14.0,<=0.19.2": ("0.14.0", "0.19.2"), ">=0.19.3,<=0.19.7": ("0.19.3", "0.19.7"),
              "==0.19.8": ("0.19.8", "0.19.8")}


def _within(version, low, high):
    return version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.14.0" and RELEASES[-1] == "0.19.8" and len(RELEASES) >= 45
    assert {"0.17.4", "0.17.5", "0.19.2", "0.19.3", "0.19.7"} <= set(RELEASES)


def test_the_patch_is_gated_by_source_only():
    assert PATCH.fixed_in is None and PATCH.fixed_marker is None and PATCH.affected == ">=0"
    assert PATCH.supported == ">=0.14.0" and not PATCH.requires
    assert [(t.module, t.qualname) for t in PATCH.targets] == [(ENGINE, q) for q in SOURCE_BANDS]
    assert PATCH.links == ("https://github.com/deepspeedai/DeepSpeed/issues/6620",
                           "https://github.com/deepspeedai/DeepSpeed/pull/6626")


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_and_diff_for_release(version, tmp_path):
    locate = extract_modules("deepspeed", version, PATCH.modules, str(tmp_path))
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    assert verdict == gating.APPLIES, reason
    for target in PATCH.targets:
        low, high = SOURCE_BANDS[target.qualname][gating.fingerprint(locate(target.module), target.qualname)]
        assert _within(version, low, high), (target, version)
    diff = PATCH.diff_for(version)
    assert diff and _within(version, *DIFF_BANDS[next(b for b, p in PATCH.diffs.items() if p == diff)])
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), diff)], cwd=tmp_path,
                   check=True)


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    """No stale entries, none missing: the accepted fingerprints are exactly those of the released sources."""
    seen = released_fingerprints(PATCH, RELEASES, tmp_path)
    for t in PATCH.targets:
        assert set(t.fingerprints) == seen[t.qualname] == set(SOURCE_BANDS[t.qualname]), t


def test_diff_bands_cover_every_release_exactly_once():
    assert set(PATCH.diffs) == set(DIFF_BANDS)
    for version in RELEASES:
        assert sum(SpecifierSet(b).contains(version) for b in PATCH.diffs) == 1, version
    for path in PATCH.diffs.values():
        text = open(os.path.join(data_dir("upstream_prs"), path)).read()
        for field in ("Description:", "Bug: https://github.com/deepspeedai/DeepSpeed/issues/6620",
                      "Forwarded: no", "Last-Update: 2026-11-23", "dspatch-Id: deepspeed/frozen-param-names"):
            assert field in text, (path, field)
        # the same change in every band: one method added, one call in each of the three functions
        body = text.split("\n---\n", 1)[1].split("\n-- \n", 1)[0]  # between the stat and the signature
        added = [line[1:].strip() for line in body.splitlines() if line.startswith("+") and not line.startswith("+++")]
        assert not [line for line in body.splitlines() if line.startswith("-") and not line.startswith("---")]
        calls = [line for line in added if line.startswith("self._refresh_param_names(")]
        assert calls == ["self._refresh_param_names()", "self._refresh_param_names(check=False)",
                         "self._refresh_param_names(update=False)"], (path, calls)


def test_versions_outside_the_written_range_and_future_ones(tmp_path):
    def verdict(version, locate=lambda m: None):
        return gating.evaluate(PATCH, version=version, locate=locate)[1]

    assert verdict("0.13.5") == gating.UNSUPPORTED
    latest = extract_modules("deepspeed", "0.19.8", PATCH.modules, str(tmp_path / "latest"))
    # a later release with the same source gets the fix
    assert verdict("0.20.0", latest) == gating.APPLIES and verdict("0.19.9+g1234", latest) == gating.APPLIES


@pytest.mark.parametrize("qualname", list(SOURCE_BANDS))
def test_a_change_to_any_one_target_is_drifted(qualname, tmp_path):
    """A later release (or a fork) whose source of one target changed is left out, whatever its number."""
    latest = extract_modules("deepspeed", "0.19.8", PATCH.modules, str(tmp_path))
    path = latest(ENGINE)
    node = gating.definition(path, qualname)
    lines = open(path).read().split("\n")
    last = node.body[-1]
    lines.insert(last.lineno - 1, lines[last.lineno - 1][:last.col_offset] + "_local_change = None")
    open(path, "w").write("\n".join(lines))
    for version in ("0.19.8", "0.20.0"):
        _, verdict, reason = gating.evaluate(PATCH, version=version, locate=latest)
        assert verdict == gating.DRIFTED and f"{ENGINE}:{qualname}" in reason, (version, reason)
