"""transformers/trainer-scheduler-after-deepspeed against every released transformers 4.44.0-5.1.0 (sdists from PyPI,
nothing executed): fixed upstream in 5.2.0 (5.1.0 reordered the scheduler's creation, 5.2.0 fixed 5.1.0's
unprepared model), so releases before 5.2.0 in `supported` get the patch when their source is a known one; every
release's targets are rebuilt by the patch's transforms (the same AST the diff of its band gives: parity of the
two forms, checked statically here for every release); every diff band applies to every release of its band.

transformers sdists are large (~10 MB each): only the two files the patch touches are read, once, into the
release cache (`<DSPATCH_RELEASE_CACHE>/src-files/`)."""
import ast
import copy
import os
import subprocess

import pytest
from packaging.specifiers import SpecifierSet

from dspatch import data_dir, gating, registry

from upstream_releases import release_files, sdist_versions

pytestmark = pytest.mark.unit_only

PID = "transformers/trainer-scheduler-after-deepspeed"
PATCH = registry.all_patches()[PID]
RELEASES = sdist_versions("transformers", "4.44.0", "5.1.0")
TRAINER = "transformers.trainer"
DS = "transformers.integrations.deepspeed"
FILES = {TRAINER: "transformers/trainer.py", DS: "transformers/integrations/deepspeed.py"}
SOURCE_BANDS = {
    "Trainer._inner_training_loop": {
        "419064e85a84cdd2": ("4.44.0", "4.44.2"), "f58cf18206848c07": ("4.45.0", "4.45.2"),
        "973a19a66e71580d": ("4.46.1", "4.46.1"), "517c903a761dd787": ("4.46.2", "4.46.2"),
        "cabc488f69e433bb": ("4.46.3", "4.46.3"), "7eb039186784bc2e": ("4.47.0", "4.47.0"),
        "347f4c6c2dfefe20": ("4.47.1", "4.48.3"), "09ee6adf0b594ab6": ("4.49.0", "4.49.0"),
        "2a245920868e5036": ("4.50.0", "4.50.3"), "bcca06c813a74b28": ("4.51.0", "4.51.3"),
        "7ae46c3373085748": ("4.52.1", "4.52.4"), "e85ca5f963c2394c": ("4.53.0", "4.53.0"),
        "e5fe2d47a7ba78d2": ("4.53.1", "4.53.3"), "1535aaddc82d8918": ("4.54.0", "4.54.1"),
        "1bd100af9bbdbb3f": ("4.55.0", "4.56.2"), "0f0445ff11bcfa8b": ("4.57.1", "4.57.6"),
        "fe515e645af0dfc0": ("5.0.0", "5.0.0"), "4efee8bbf78575ff": ("5.1.0", "5.1.0")},
    "deepspeed_optim_sched": {
        "1562528105546383": ("4.44.0", "4.56.2"), "830f2ca2c63534ec": ("4.57.1", "4.57.6"),
        "5d0b6134408cef4b": ("5.0.0", "5.0.0"), "b30c31db9802bdbc": ("5.1.0", "5.1.0")},
}
DIFF_BANDS = {">=4.44.0,<=4.56.2": ("4.44.0", "4.56.2"), ">=4.57.1,<=4.57.6": ("4.57.1", "4.57.6"),
              "==5.0.0": ("5.0.0", "5.0.0"), "==5.1.0": ("5.1.0", "5.1.0")}


def locate(version):
    files = release_files("transformers", version, list(FILES.values()))
    return {module: files[path] for module, path in FILES.items()}.get


def _within(version, low, high):
    return version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]


def _tree_with(version, tmp_path, diff=None):
    """A src/ tree of the release's two files, with `diff` applied; returns locate for it."""
    files = release_files("transformers", version, list(FILES.values()))
    for path in files:
        target = tmp_path / "src" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(open(files[path], "rb").read())
    if diff:
        subprocess.run(["git", "apply", os.path.join(data_dir("upstream_prs"), diff)], cwd=tmp_path, check=True)
    return {module: str(tmp_path / "src" / path) for module, path in FILES.items()}.get


def test_the_release_list_is_complete():
    assert RELEASES[0] == "4.44.0" and RELEASES[-1] == "5.1.0" and len(RELEASES) == 50
    assert {"4.44.2", "4.46.3", "4.56.2", "4.57.1", "4.57.6", "5.0.0"} <= set(RELEASES)


def test_declaration():
    assert PATCH.affected == "<5.2.0" and PATCH.fixed_in == "5.2.0" and PATCH.supported == ">=4.44.0"
    assert [(t.module, t.qualname) for t in PATCH.targets] == [(TRAINER, "Trainer._inner_training_loop"),
                                                               (DS, "deepspeed_optim_sched")]
    assert "https://github.com/huggingface/transformers/pull/43711" in PATCH.links
    assert "https://github.com/huggingface/transformers/pull/43780" in PATCH.links


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_transform_and_diff_for_release(version, tmp_path):
    """Applies; each target's fingerprint is in its band; the transforms rebuild both targets; the band's diff
    applies and gives the same code (AST) as the transforms."""
    from dspatch.patches.transformers import trainer_scheduler_after_deepspeed as P

    where = locate(version)
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=where)
    assert verdict == gating.APPLIES, reason
    for target in PATCH.targets:
        low, high = SOURCE_BANDS[target.qualname][gating.fingerprint(where(target.module), target.qualname)]
        assert _within(version, low, high), (target, version)
    diff = PATCH.diff_for(version)
    assert diff and _within(version, *DIFF_BANDS[next(b for b, p in PATCH.diffs.items() if p == diff)])
    patched = _tree_with(version, tmp_path, diff)
    for target, transform in ((PATCH.targets[0], P.transform_trainer),
                              (PATCH.targets[1], P.no_scheduler_on_the_raw_optimizer)):
        node = copy.deepcopy(gating.definition(where(target.module), target.qualname))
        if target.module == DS and not P.builds_scheduler_before_prepare(node):
            assert version == "5.1.0"  # 5.1.0 builds no scheduler there: left as it is, and the diff leaves it
        else:
            transform(node)
        by_diff = gating.definition(patched(target.module), target.qualname)
        assert ast.dump(node) == ast.dump(by_diff), (version, target)


def test_every_recorded_fingerprint_matches_a_release():
    seen = {t.qualname: set() for t in PATCH.targets}
    for version in RELEASES:
        where = locate(version)
        for t in PATCH.targets:
            seen[t.qualname].add(gating.fingerprint(where(t.module), t.qualname))
    for t in PATCH.targets:
        assert set(t.fingerprints) == seen[t.qualname] == set(SOURCE_BANDS[t.qualname]), t


def test_diff_bands_cover_every_release_exactly_once():
    assert set(PATCH.diffs) == set(DIFF_BANDS)
    for version in RELEASES:
        assert sum(SpecifierSet(b).contains(version) for b in PATCH.diffs) == 1, version
    for band, path in PATCH.diffs.items():
        text = open(os.path.join(data_dir("upstream_prs"), path)).read()
        for field in ("Bug: https://github.com/huggingface/transformers/pull/43692", "Forwarded: not-needed",
                      "Applied-Upstream: 5.", "https://github.com/huggingface/transformers/pull/43780",
                      "Last-Update: 2026-11-23", f"dspatch-Id: {PID}"):
            assert field in text, (path, field)


def test_versions_outside_the_written_range():
    def verdict(version, where=lambda m: None):
        return gating.evaluate(PATCH, version=version, locate=where)[1]

    assert verdict("4.43.4") == gating.UNSUPPORTED
    for version in ("5.2.0", "5.3.0", "5.23.0"):
        assert verdict(version) == gating.FIXED_UPSTREAM
    # a dev build of 5.1 whose source is 5.1.0's still has the regression; one with other source is drifted
    assert verdict("5.1.1.dev0", locate("5.1.0")) == gating.APPLIES


@pytest.mark.parametrize("qualname", list(SOURCE_BANDS))
def test_a_change_to_any_one_target_is_drifted(qualname, tmp_path):
    where = _tree_with("4.57.6", tmp_path)
    module = next(t.module for t in PATCH.targets if t.qualname == qualname)
    path = where(module)
    node = gating.definition(path, qualname)
    lines = open(path).read().split("\n")
    last = node.body[-1]
    lines.insert(last.lineno - 1, lines[last.lineno - 1][:last.col_offset] + "_local_change = None")
    open(path, "w").write("\n".join(lines))
    _, verdict, reason = gating.evaluate(PATCH, version="4.57.6", locate=where)
    assert verdict == gating.DRIFTED and f"{module}:{qualname}" in reason, reason
