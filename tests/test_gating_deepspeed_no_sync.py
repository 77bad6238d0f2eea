"""accelerate/deepspeed-no-sync against every released accelerate 0.20.0-1.15.0 and deepspeed 0.14.0-0.19.8 (sdists
from PyPI, nothing executed): accelerate 0.26.0-1.8.1 get the patch where deepspeed >= 0.16.0 is installed (one
released source of Accelerator.no_sync), 1.9.0 on are fixed upstream; deepspeed has the asserting no_sync from
0.16.0 on, in every release up to 0.19.8; the diff applies to every release of its band."""
import os
import subprocess
import tarfile

import pytest

from dspatch import data_dir, gating, registry

from upstream_releases import sdist, sdist_versions

pytestmark = pytest.mark.unit_only

PATCH = registry.all_patches()["accelerate/deepspeed-no-sync"]
RELEASES = sdist_versions("accelerate", "0.20.0", "1.15.0")
DEEPSPEED = sdist_versions("deepspeed", "0.14.0", "0.19.8")
MODULE = "accelerate.accelerator"
# the released source of Accelerator.no_sync, by band (recomputed below from every sdist)
SOURCE_BANDS = {"3c6094b633f6a292": ("0.20.0", "1.8.1"), "6f4b532efb75039f": ("1.9.0", "1.10.1"),
                "0fd6aeccd8fca8a2": ("1.11.0", "1.15.0")}
DIFF = "accelerate/0002-deepspeed-no-sync-0.26.0-1.8.1.patch"


def _within(version, low, high):
    return version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]


def _accelerator_source(version, into):
    """accelerate's sdists keep the package under src/: write src/accelerate/accelerator.py as the repository
    has it (for the diff) and return a locate function for gating.evaluate."""
    path = os.path.join(str(into), "src", "accelerate", "accelerator.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(_member("accelerate", version, "src/accelerate/accelerator.py"))
    return lambda module: path if module == MODULE else None


def _member(project, version, relative):
    """One file of a cached sdist, read as the archive streams (stops at that file)."""
    with tarfile.open(sdist(project, version), "r|gz") as tar:
        for member in tar:
            if member.isfile() and member.name.split("/", 1)[-1] == relative:
                return tar.extractfile(member).read()
    raise FileNotFoundError(f"{project} {version}: {relative}")


def test_the_release_lists_are_complete():
    assert RELEASES[0] == "0.20.0" and RELEASES[-1] == "1.15.0" and {"0.26.0", "1.8.1", "1.9.0"} <= set(RELEASES)
    assert DEEPSPEED[0] == "0.14.0" and DEEPSPEED[-1] == "0.19.8" and {"0.15.4", "0.16.0"} <= set(DEEPSPEED)


def test_declaration():
    assert PATCH.distribution == "accelerate" and PATCH.affected == "<1.9.0" and PATCH.fixed_in == "1.9.0"
    assert PATCH.requires == {"deepspeed": ">=0.16.0"} and PATCH.supported == ">=0.26.0"
    assert [(t.module, t.qualname) for t in PATCH.targets] == [(MODULE, "Accelerator.no_sync")]
    assert PATCH.diffs == {">=0.26.0,<=1.8.1": DIFF}
    assert "https://github.com/huggingface/accelerate/pull/3656" in PATCH.links


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_and_diff_for_release(version, tmp_path):
    locate = _accelerator_source(version, tmp_path)
    fingerprint = gating.fingerprint(locate(MODULE), "Accelerator.no_sync")
    assert _within(version, *SOURCE_BANDS[fingerprint])
    with_bug = gating.evaluate(PATCH, version=version, locate=locate, others={"deepspeed": "0.16.9"})
    without = gating.evaluate(PATCH, version=version, locate=locate, others={"deepspeed": "0.15.4"})
    diff = os.path.join(data_dir("upstream_prs"), DIFF)
    applies = subprocess.run(["git", "apply", "--check", diff], cwd=tmp_path, capture_output=True).returncode == 0
    if _within(version, "1.9.0", "1.15.0"):
        assert with_bug[1] == without[1] == gating.FIXED_UPSTREAM and not applies
    elif _within(version, "0.26.0", "1.8.1"):
        # the verdict says which combination it saw
        assert with_bug[1] == gating.APPLIES
        assert "with deepspeed 0.16.9 (the bug needs deepspeed>=0.16.0)" in with_bug[2]
        assert without[1] == gating.NOT_AFFECTED and "deepspeed>=0.16.0; deepspeed 0.15.4 is installed" in without[2]
        assert PATCH.diff_for(version) == DIFF and applies, version
    else:
        assert with_bug[1] == gating.UNSUPPORTED and PATCH.diff_for(version) is None


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    seen = {gating.fingerprint(_accelerator_source(v, tmp_path / v)(MODULE), "Accelerator.no_sync")
            for v in RELEASES if _within(v, "0.26.0", "1.8.1")}
    assert set(PATCH.targets[0].fingerprints) == seen == {"3c6094b633f6a292"}


def test_deepspeed_has_the_asserting_no_sync_from_0_16_0():
    """The second half of the gate: `DeepSpeedEngine.no_sync` exists, and asserts that gradients are not
    partitioned, in exactly the releases `requires` names (0.14.0-0.15.4 have no no_sync at all)."""
    import ast

    from packaging.specifiers import SpecifierSet

    for version in DEEPSPEED:
        tree = ast.parse(_member("deepspeed", version, "deepspeed/runtime/engine.py"))
        node = gating.find_definition(tree, "DeepSpeedEngine.no_sync")
        asserting = node is not None and any(
            isinstance(n, ast.Assert) and "zero_optimization_partition_gradients" in ast.dump(n.test)
            for n in ast.walk(node))
        assert asserting == SpecifierSet(PATCH.requires["deepspeed"]).contains(version), version
        assert (node is None) == (not asserting), version


def test_a_changed_no_sync_is_drifted(tmp_path):
    locate = _accelerator_source("1.8.1", tmp_path)
    path = locate(MODULE)
    node = gating.definition(path, "Accelerator.no_sync")
    lines = open(path).read().split("\n")
    last = node.body[-1]
    lines.insert(last.lineno - 1, lines[last.lineno - 1][:last.col_offset] + "_local_change = None")
    open(path, "w").write("\n".join(lines))
    for version in ("1.8.1", "1.8.2.dev0"):
        _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate, others={"deepspeed": "0.16.9"})
        assert verdict == gating.DRIFTED and "Accelerator.no_sync" in reason, (version, reason)


def test_diff_header():
    text = open(os.path.join(data_dir("upstream_prs"), DIFF)).read()
    for field in ("Bug: https://github.com/huggingface/accelerate/issues/3481",
                  "Applied-Upstream: 1.9.0, https://github.com/huggingface/accelerate/pull/3656",
                  "Forwarded: not-needed", "Last-Update: 2026-11-23", "dspatch-Id: accelerate/deepspeed-no-sync",
                  "--- a/src/accelerate/accelerator.py"):
        assert field in text, field


def test_the_trainer_reaches_deepspeeds_no_sync_only_through_accelerate():
    """Why there is no transformers patch: the Trainer of every release 4.46.1-4.47.1 (4.46.0 has no sdist) enters
    no_sync only as `self.accelerator.no_sync` (4.46.2-4.47.0 on each micro-step but the last of a window, 4.47.1
    not under DeepSpeed; 4.46.1 through accumulate only), so the fixed Accelerator.no_sync (this patch, or
    accelerate >= 1.9.0) covers it."""
    import ast

    direct = []
    for version in sdist_versions("transformers", "4.46.0", "4.47.1"):
        tree = ast.parse(_member("transformers", version, "src/transformers/trainer.py"))
        uses = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and node.attr == "no_sync"]
        assert set(uses) <= {"self.accelerator.no_sync"}, (version, uses)
        direct += [version] if uses else []
    assert direct == ["4.46.2", "4.46.3", "4.47.0", "4.47.1"]
