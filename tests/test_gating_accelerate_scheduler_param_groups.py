"""accelerate/deepspeed-scheduler-param-groups against every released accelerate 0.34.0-1.15.0 (sdists from PyPI,
nothing executed): open upstream (no fixed release), so the fingerprint of `Accelerator._prepare_deepspeed` decides;
every release gets the patch, a later one only while that source is unchanged; every diff band applies to every
release of its band, and the last band's diff is the one to forward (against 1.15.0)."""
import os
import subprocess

import pytest
from packaging.specifiers import SpecifierSet

from dspatch import data_dir, gating, registry

from upstream_releases import release_files, sdist_versions

pytestmark = pytest.mark.unit_only

PID = "accelerate/deepspeed-scheduler-param-groups"
PATCH = registry.all_patches()[PID]
RELEASES = sdist_versions("accelerate", "0.34.0", "1.15.0")
MODULE = "accelerate.accelerator"
QUALNAME = "Accelerator._prepare_deepspeed"
FILES = ["accelerate/accelerator.py", "accelerate/utils/deepspeed.py"]
SOURCE_BANDS = {"1d49bcac810166d4": ("0.34.0", "0.34.2"), "23ef336f9b8dadce": ("1.0.0", "1.0.1"),
                "c7be814f177e6676": ("1.1.1", "1.1.1"), "594e9ce52cf1f586": ("1.2.0", "1.3.0"),
                "964e2e06fe6b9e01": ("1.4.0", "1.4.0"), "b89b980a86ecf24d": ("1.5.0", "1.5.2"),
                "84a6315ca8c39dab": ("1.6.0", "1.6.0"), "e3a169fd2efb2338": ("1.7.0", "1.7.0"),
                "b042ba2bd4cf729f": ("1.8.0", "1.8.1"), "74ccdda66f159504": ("1.9.0", "1.11.0"),
                "3435112598fde91d": ("1.12.0", "1.12.0"), "3d4fd221002236b1": ("1.13.0", "1.14.0"),
                "0bb61e9f116e1147": ("1.15.0", "1.15.0")}
DIFF_BANDS = {">=0.34.0,<=0.34.2": ("0.34.0", "0.34.2"), ">=1.0.0,<=1.0.1": ("1.0.0", "1.0.1"),
              ">=1.1.1,<=1.4.0": ("1.1.1", "1.4.0"), ">=1.5.0,<=1.11.0": ("1.5.0", "1.11.0"),
              ">=1.12.0,<=1.15.0": ("1.12.0", "1.15.0")}


def locate(version):
    return {MODULE: release_files("accelerate", version, FILES)[FILES[0]]}.get


def _within(version, low, high):
    return version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.34.0" and RELEASES[-1] == "1.15.0" and len(RELEASES) == 25
    assert {"0.34.2", "1.8.1", "1.10.1", "1.11.0", "1.12.0"} <= set(RELEASES)


def test_the_patch_is_gated_by_source_only():
    assert PATCH.fixed_in is None and PATCH.fixed_marker is None and PATCH.affected == ">=0"
    assert PATCH.supported == ">=0.34.0" and not PATCH.requires
    assert [(t.module, t.qualname) for t in PATCH.targets] == [(MODULE, QUALNAME)]


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_and_diff_for_release(version, tmp_path):
    where = locate(version)
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=where)
    assert verdict == gating.APPLIES, reason
    assert _within(version, *SOURCE_BANDS[gating.fingerprint(where(MODULE), QUALNAME)])
    diff = PATCH.diff_for(version)
    assert diff and _within(version, *DIFF_BANDS[next(b for b, p in PATCH.diffs.items() if p == diff)])
    files = release_files("accelerate", version, FILES)
    for path in FILES:
        target = tmp_path / "src" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(open(files[path], "rb").read())
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), diff)], cwd=tmp_path,
                   check=True)


def test_every_recorded_fingerprint_matches_a_release():
    seen = {gating.fingerprint(locate(v)(MODULE), QUALNAME) for v in RELEASES}
    assert set(PATCH.targets[0].fingerprints) == seen == set(SOURCE_BANDS)


def test_diff_bands_cover_every_release_exactly_once():
    assert set(PATCH.diffs) == set(DIFF_BANDS)
    for version in RELEASES:
        assert sum(SpecifierSet(b).contains(version) for b in PATCH.diffs) == 1, version
    assert PATCH.diff_for("1.15.0") == "accelerate/0001-deepspeed-scheduler-param-groups.patch"
    for path in PATCH.diffs.values():
        text = open(os.path.join(data_dir("upstream_prs"), path)).read()
        for field in ("Bug: https://github.com/huggingface/transformers/pull/43692", "Forwarded: no",
                      "Last-Update: 2026-11-23", f"dspatch-Id: {PID}",
                      "+def realign_scheduler_param_groups(scheduler, groups_before):",
                      "+                        realign_scheduler_param_groups(scheduler, scheduler_param_groups)"):
            assert field in text, (path, field)


def test_versions_outside_the_written_range_and_future_ones():
    assert gating.evaluate(PATCH, version="0.33.0", locate=lambda m: None)[1] == gating.UNSUPPORTED
    latest = locate("1.15.0")
    assert gating.evaluate(PATCH, version="1.16.0", locate=latest)[1] == gating.APPLIES


def test_a_change_to_the_target_is_drifted(tmp_path):
    path = tmp_path / "accelerator.py"
    path.write_bytes(open(locate("1.15.0")(MODULE), "rb").read())
    node = gating.definition(str(path), QUALNAME)
    lines = path.read_text().split("\n")
    last = node.body[-1]
    lines.insert(last.lineno - 1, lines[last.lineno - 1][:last.col_offset] + "_local_change = None")
    path.write_text("\n".join(lines))
    for version in ("1.15.0", "1.16.0"):
        _, verdict, reason = gating.evaluate(PATCH, version=version, locate=lambda m: str(path))
        assert verdict == gating.DRIFTED and f"{MODULE}:{QUALNAME}" in reason, reason
