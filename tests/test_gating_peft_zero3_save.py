"""transformers/peft-zero3-save against every released transformers 4.44.0-5.0.0 (sdists from PyPI, only
src/transformers/trainer.py extracted, nothing executed): every release 4.44.0-4.57.6 has the DeepSpeed branch of
Trainer.save_model that saves an empty adapter and gets the patch (four source bands of the function, one
diff band); 5.0.0 (PR 41416) is fixed upstream; the diff applies to every release of its band."""
import functools
import os
import subprocess
import tarfile

import pytest

from dspatch import data_dir, gating, registry

from upstream_releases import sdist, sdist_versions

pytestmark = pytest.mark.unit_only

PATCH = registry.all_patches()["transformers/peft-zero3-save"]
RELEASES = sdist_versions("transformers", "4.44.0", "4.57.6")
TRAINER = "transformers.trainer"
MEMBER = "src/transformers/trainer.py"  # transformers' sdists use the src/ layout
# the released source of Trainer.save_model, by band (recomputed below from every sdist)
SOURCE_BANDS = {"739c927f4e756a64": ("4.44.0", "4.52.4"), "e9febda0d6908cd3": ("4.53.0", "4.54.0"),
                "ec8f18c40d9ebaea": ("4.54.1", "4.56.2"), "508e08e47123701d": ("4.57.1", "4.57.6")}
DIFF = "transformers/0002-peft-zero3-save-4.44.0-4.57.6.patch"
# the DeepSpeed branch the patch edits, as every affected release has it
BRANCH = """        elif self.is_deepspeed_enabled:
            try:
                state_dict = self.accelerator.get_state_dict(self.deepspeed)
                if self.args.should_save:
                    self._save(output_dir, state_dict=state_dict)
            except ValueError:
                logger.warning(
                    " stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use"
                    " zero_to_fp32.py to recover weights"
                )
                if self.args.should_save:
                    self._save(output_dir, state_dict={})
                # remove the dummy state_dict
                remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
                self.model_wrapped.save_checkpoint(output_dir)
"""


@functools.lru_cache(maxsize=None)
def _released_trainer(version):
    """The bytes of src/transformers/trainer.py in that release's sdist (read once per session; the archive is
    read only up to that member)."""
    with tarfile.open(sdist("transformers", version)) as tar:
        for member in tar:
            if member.isfile() and member.name.split("/", 1)[-1] == MEMBER:
                with tar.extractfile(member) as src:
                    return src.read()
    raise AssertionError(f"transformers {version}: no {MEMBER} in its sdist")


def _extract(version, into):
    """src/transformers/trainer.py of that release under `into` (as in the repository); returns a locate
    function for dspatch.gating.evaluate."""
    path = os.path.join(str(into), MEMBER)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as dst:
        dst.write(_released_trainer(version))
    return {TRAINER: path}.get


def test_the_release_list_is_complete():
    assert RELEASES[0] == "4.44.0" and RELEASES[-1] == "4.57.6" and len(RELEASES) >= 48
    assert {"4.46.3", "4.52.4", "4.53.0", "4.54.0", "4.54.1", "4.56.2", "4.57.1"} <= set(RELEASES)


def test_declaration():
    assert PATCH.distribution == "transformers" and PATCH.affected == "<5.0.0" and PATCH.fixed_in == "5.0.0"
    assert PATCH.supported == ">=4.44.0" and not PATCH.requires and PATCH.fixed_marker is None
    assert [(t.module, t.qualname) for t in PATCH.targets] == [(TRAINER, "Trainer.save_model")]
    assert PATCH.diffs == {">=4.44.0,<=4.57.6": DIFF}
    assert "https://github.com/huggingface/transformers/pull/41416" in PATCH.links


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_and_diff_for_release(version, tmp_path):
    locate = _extract(version, tmp_path)
    source = open(locate(TRAINER)).read()
    assert source.count(BRANCH) == 1, version  # the bug's code, unchanged in every affected release
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    assert verdict == gating.APPLIES, reason
    low, high = SOURCE_BANDS[gating.fingerprint(locate(TRAINER), "Trainer.save_model")]
    assert version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]
    assert PATCH.diff_for(version) == DIFF
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), DIFF)], cwd=tmp_path,
                   check=True)


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    seen = {gating.fingerprint(_extract(v, tmp_path / v)(TRAINER), "Trainer.save_model") for v in RELEASES}
    assert set(PATCH.targets[0].fingerprints) == seen == set(SOURCE_BANDS)


def test_fixed_upstream_release(tmp_path):
    """5.0.0 changed exactly that branch (PR 41416): the verdict is 'fixed upstream', its source is another
    fingerprint, and the diff does not apply to it."""
    locate = _extract("5.0.0", tmp_path)
    assert BRANCH not in open(locate(TRAINER)).read()
    assert gating.fingerprint(locate(TRAINER), "Trainer.save_model") not in PATCH.targets[0].fingerprints
    _, verdict, _ = gating.evaluate(PATCH, version="5.0.0", locate=locate)
    assert verdict == gating.FIXED_UPSTREAM
    assert PATCH.diff_for("5.0.0") is None
    proc = subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), DIFF)], cwd=tmp_path,
                          capture_output=True)
    assert proc.returncode != 0


def test_versions_outside_the_written_range(tmp_path):
    assert gating.evaluate(PATCH, version="4.43.4", locate=lambda m: None)[1] == gating.UNSUPPORTED
    assert gating.evaluate(PATCH, version="5.23.0", locate=lambda m: None)[1] == gating.FIXED_UPSTREAM


def test_a_changed_save_model_is_drifted(tmp_path):
    locate = _extract("4.57.6", tmp_path)
    path = locate(TRAINER)
    node = gating.definition(path, "Trainer.save_model")
    lines = open(path).read().split("\n")
    last = node.body[-1]
    lines.insert(last.lineno - 1, lines[last.lineno - 1][:last.col_offset] + "_local_change = None")
    open(path, "w").write("\n".join(lines))
    _, verdict, reason = gating.evaluate(PATCH, version="4.57.6", locate=locate)
    assert verdict == gating.DRIFTED and "Trainer.save_model" in reason


def test_the_diff_header():
    text = open(os.path.join(data_dir("upstream_prs"), DIFF)).read()
    for field in ("Description:", "Bug: https://github.com/huggingface/trl/issues/4416",
                  "Forwarded: not-needed",
                  "Applied-Upstream: 5.0.0, https://github.com/huggingface/transformers/pull/41416",
                  "Last-Update: 2026-11-23", "dspatch-Id: transformers/peft-zero3-save"):
        assert field in text, field
    body = text.split("\n---\n", 1)[1].split("\n-- \n", 1)[0]
    removed = [line for line in body.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-                state_dict = self.accelerator.get_state_dict(self.deepspeed)"]


def test_signatures_match_the_stock_warning_only():
    import re

    line = (" stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use"
            " zero_to_fp32.py to recover weights")
    assert line.strip() in BRANCH.replace('"\n                    "', "")  # the Trainer's own words
    assert any(re.search(s, line) for s in PATCH.signatures)
    for other in ("ValueError: Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` "
                  "in DeepSpeed config is False.", "Saving model checkpoint to out/checkpoint-2"):
        assert not any(re.search(s, other) for s in PATCH.signatures)
