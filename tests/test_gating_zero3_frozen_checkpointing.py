"""deepspeed/zero3-frozen-checkpointing against every released deepspeed 0.14.0-0.19.8 (sdists from PyPI, nothing
executed): affected before 0.19.3 (fixed there by PR 8148), the forward-release hook's source in five bands over
0.14.0-0.19.2; 0.19.3 and later are fixed (they have PR 8148's `release_backward_leftovers`)."""
import pytest

from dspatch import gating, registry

from upstream_releases import extract_modules, released_fingerprints, sdist_versions

pytestmark = pytest.mark.unit_only

PATCH = registry.all_patches()["deepspeed/zero3-frozen-checkpointing"]
RELEASES = sdist_versions("deepspeed", "0.14.0", "0.19.8")
AFFECTED = [v for v in RELEASES if tuple(map(int, v.split("."))) < (0, 19, 3)]
SOURCE_BANDS = {"7afccceb166e3708": ("0.14.0", "0.15.3"), "d7a3471a831c5bc1": ("0.15.4", "0.16.3"),
                "1d6b2192d969f6cb": ("0.16.4", "0.16.9"), "a476dcf9d180069b": ("0.17.0", "0.18.0"),
                "2dc4a478cb2eec93": ("0.18.1", "0.19.2")}


def _within(version, low, high):
    return version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]


def test_declaration():
    assert PATCH.affected == "<0.19.3" and PATCH.fixed_in == "0.19.3" and PATCH.supported == ">=0.14.0"
    assert [(t.module, t.qualname) for t in PATCH.targets] == [
        ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload.post_sub_module_forward_function")]
    assert set(PATCH.targets[0].fingerprints) == set(SOURCE_BANDS)


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_for_release(version, tmp_path):
    modules = [*PATCH.modules, PATCH.fixed_marker[0]]
    locate = extract_modules("deepspeed", version, modules, str(tmp_path))
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    if version in AFFECTED:
        assert verdict == gating.APPLIES, reason
        target = PATCH.targets[0]
        assert _within(version, *SOURCE_BANDS[gating.fingerprint(locate(target.module), target.qualname)])
        # the fix is not in: no release_backward_leftovers in the coordinator
        assert gating.definition(locate(PATCH.fixed_marker[0]), PATCH.fixed_marker[1]) is None
    else:
        assert verdict != gating.APPLIES, reason
        assert gating.definition(locate(PATCH.fixed_marker[0]), PATCH.fixed_marker[1]) is not None


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    seen = released_fingerprints(PATCH, AFFECTED, tmp_path)
    assert seen[PATCH.targets[0].qualname] == set(SOURCE_BANDS)


def test_a_drifted_target_is_left_out(tmp_path):
    locate = extract_modules("deepspeed", "0.19.2", PATCH.modules, str(tmp_path))
    path = locate(PATCH.targets[0].module)
    node = gating.definition(path, PATCH.targets[0].qualname)
    lines = open(path).read().split("\n")
    last = node.body[-1]
    lines.insert(last.lineno - 1, lines[last.lineno - 1][:last.col_offset] + "_local_change = None")
    open(path, "w").write("\n".join(lines))
    _, verdict, reason = gating.evaluate(PATCH, version="0.19.2", locate=locate)
    assert verdict == gating.DRIFTED, reason


@pytest.mark.parametrize("version", AFFECTED)
def test_the_band_diff_applies_to_the_release(version, tmp_path):
    import os
    import subprocess

    from dspatch import data_dir

    extract_modules("deepspeed", version, PATCH.modules, str(tmp_path))
    diff = PATCH.diff_for(version)
    assert diff, version
    text = open(os.path.join(data_dir("upstream_prs"), diff)).read()
    for field in ("Applied-Upstream: 0.19.3, https://github.com/deepspeedai/DeepSpeed/pull/8148",
                  "dspatch-Id: deepspeed/zero3-frozen-checkpointing", "Last-Update: 2026-11-23"):
        assert field in text, (diff, field)
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), diff)], cwd=tmp_path,
                   check=True)
