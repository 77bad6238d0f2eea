"""trl/ppo-deepspeed-save against every released trl 0.9.2-1.16.0 (sdists from PyPI, and the wheels of the
releases that have no sdist; nothing executed), and the framework's banded targets it relies on.

The PPO trainer moved: 0.9.2-0.11.4 `trl/trainer/ppov2_trainer.py::PPOv2Trainer`, 0.12.0-0.25.1
`trl/trainer/ppo_trainer.py::PPOTrainer`, 0.26.0-1.12.0 `trl/experimental/ppo/ppo_trainer.py::PPOTrainer`, gone in
1.13.0. The bug is open upstream: in 0.11.0-1.12.0 the fingerprint of `save_model` at the release's own location
decides; 0.9.x saves correctly (it gathers from the engine itself); 0.10.x has the same `save_model` but never sets
`self.deepspeed` (trl#2025), so it fails before the bug; 1.13.0+ has no PPO trainer."""
import os
import subprocess
import zipfile

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dspatch import data_dir, gating, registry
from dspatch.spec import Patch, Target

from upstream_releases import extract_modules, sdist, sdist_versions, wheel

pytestmark = pytest.mark.unit_only

PID = "trl/ppo-deepspeed-save"
PATCH = registry.all_patches()[PID]
SDISTS = sdist_versions("trl", "0.9.0", "1.16.0")
WHEEL_ONLY = ["0.9.2", "0.9.3", "0.9.4", "0.9.6", "0.12.1"]  # releases PyPI has no sdist of
RELEASES = sorted(SDISTS + WHEEL_ONLY, key=Version)
PPOV2, PPO, EXPERIMENTAL = "trl.trainer.ppov2_trainer", "trl.trainer.ppo_trainer", "trl.experimental.ppo.ppo_trainer"
# where save_model is, and its released source, by band (recomputed below from every release)
LOCATIONS = {PPOV2: ("PPOv2Trainer.save_model", "0.11.0", "0.11.4"),
             PPO: ("PPOTrainer.save_model", "0.12.0", "0.25.1"),
             EXPERIMENTAL: ("PPOTrainer.save_model", "0.26.0", "1.12.0")}
SOURCE_BANDS = {"054c3942bd1f272e": ("0.10.1", "0.24.0"),  # 0.10.1-0.11.4 ppov2, 0.12.0-0.24.0 ppo_trainer
                "a97148c67e89826f": ("0.25.0", "0.28.0"),  # `str | None`; 0.26.0 moved it to experimental/
                "4de6f0b0aaf98f4f": ("0.29.0", "1.12.0")}  # `if hasattr(self.model, "policy")`
DIFFS = {">=0.11.0,<0.12.0": ("trl/0001-ppo-deepspeed-save-ppov2_trainer-0.11.0-0.11.4.patch", "0.11.0", "0.11.4"),
         ">=0.12.0,<0.26.0": ("trl/0001-ppo-deepspeed-save-ppo_trainer-0.12.0-0.25.1.patch", "0.12.0", "0.25.1"),
         ">=0.26.0,<1.13.0": ("trl/0001-ppo-deepspeed-save-experimental-0.26.0-1.12.0.patch", "0.26.0", "1.12.0")}


def _within(version, low, high):
    return version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]


def _release_files(version, into):
    """(locate for the three PPO modules, every .py path of the release's trl package)."""
    modules = [PPOV2, PPO, EXPERIMENTAL]
    if version not in WHEEL_ONLY:
        import tarfile

        with tarfile.open(sdist("trl", version)) as tar:
            names = [m.name.split("/", 1)[-1] for m in tar.getmembers() if m.isfile()]
        return extract_modules("trl", version, modules, str(into)), [n for n in names if n.startswith("trl/")]
    found = {}
    with zipfile.ZipFile(wheel("trl", version)) as whl:
        names = whl.namelist()
        for module in modules:
            relative = module.replace(".", "/") + ".py"
            if relative in names:
                target = os.path.join(str(into), relative)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(whl.read(relative))
                found[module] = target
    return found.get, [n for n in names if n.startswith("trl/")]


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.9.2" and RELEASES[-1] == "1.16.0" and len(RELEASES) >= 65
    assert not set(WHEEL_ONLY) & set(SDISTS)
    assert {"0.10.1", "0.11.0", "0.11.4", "0.12.0", "0.25.1", "0.26.0", "0.28.0", "0.29.0", "1.12.0",
            "1.13.0"} <= set(SDISTS)


def test_the_patch_is_gated_by_source_in_each_band():
    assert PATCH.fixed_in is None and PATCH.fixed_marker is None and not PATCH.requires
    assert PATCH.affected == ">=0.11.0,<1.13.0" and PATCH.supported == ">=0.11.0"
    assert [(t.module, t.qualname) for t in PATCH.all_targets] == [(m, q) for m, (q, _, _) in LOCATIONS.items()]
    assert [t.releases for t in PATCH.all_targets] == [">=0.11.0,<0.12.0", ">=0.12.0,<0.26.0", ">=0.26.0"]
    assert PATCH.links == ("https://github.com/huggingface/trl/issues/2885",
                           "https://github.com/huggingface/trl/issues/2122")


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_for_release(version, tmp_path):
    locate, files = _release_files(version, tmp_path)
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    if _within(version, "0.11.0", "1.12.0"):
        assert verdict == gating.APPLIES, reason
        (target,) = PATCH.targets_for(version)
        qualname, low, high = LOCATIONS[target.module]
        assert _within(version, low, high) and target.qualname == qualname
        fingerprint = gating.fingerprint(locate(target.module), target.qualname)
        assert _within(version, *SOURCE_BANDS[fingerprint]) and fingerprint in target.fingerprints
        return
    assert verdict == gating.NOT_AFFECTED and reason == "the bug affects trl >=0.11.0,<1.13.0 only", reason
    source = open(locate(PPOV2)).read() if locate(PPOV2) else ""
    if version.startswith("0.9."):  # saves correctly: gathers from the engine, strips "policy." itself
        assert "self.deepspeed" not in source and 'k.startswith("policy.")' in source
        assert "state_dict = self.accelerator.get_state_dict(self.backup_model)" in source
    elif version.startswith("0.10."):  # the same save_model, but nothing ever sets self.deepspeed (trl#2025)
        assert gating.fingerprint(locate(PPOV2), "PPOv2Trainer.save_model") == "054c3942bd1f272e"
        assigned = [line.strip() for line in source.splitlines() if line.strip().startswith("self.deepspeed =")]
        assert assigned == ["self.deepspeed = self.model", "self.deepspeed = backup_deepspeed"]  # save_model's own
    else:  # 1.13.0 and later: no PPO trainer at all
        assert Version(version) >= Version("1.13.0")
        assert not [f for f in files if f.endswith(("/ppo_trainer.py", "/ppov2_trainer.py", "/ppo_config.py"))]


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    """No stale entries, none missing: each target accepts exactly the fingerprints of its band's releases."""
    for target in PATCH.all_targets:
        qualname, low, high = LOCATIONS[target.module]
        seen = {}
        for version in RELEASES[RELEASES.index(low):RELEASES.index(high) + 1]:
            locate, _ = _release_files(version, tmp_path / version)
            seen.setdefault(gating.fingerprint(locate(target.module), qualname), []).append(version)
        assert set(seen) == set(target.fingerprints), (target, seen)
        for fingerprint, versions in seen.items():
            assert all(_within(v, *SOURCE_BANDS[fingerprint]) for v in versions)
            assert target.fingerprints[fingerprint] == f"{versions[0]}-{versions[-1]}", (target, versions)


@pytest.mark.parametrize("band", list(DIFFS))
def test_each_diff_applies_to_every_release_of_its_band(band, tmp_path):
    path, low, high = DIFFS[band]
    assert PATCH.diffs[band] == path
    diff = os.path.join(data_dir("upstream_prs"), path)
    in_band = [v for v in SDISTS if SpecifierSet(band).contains(v)]
    assert in_band[0] == low and in_band[-1] == high
    for version in in_band:
        extract_modules("trl", version, [PPOV2, PPO, EXPERIMENTAL], str(tmp_path / version))
        subprocess.run(["git", "apply", "--check", diff], cwd=tmp_path / version, check=True)
    text = open(diff).read()
    for field in ("Description:", "Bug: https://github.com/huggingface/trl/issues/2885",
                  "Bug: https://github.com/huggingface/trl/issues/2122", "Forwarded: no",
                  "Last-Update: 2026-11-23", f"dspatch-Id: {PID}", f"as released on PyPI; applies as it is to every\n"
                  f" release {low}-{high}."):
        assert field in text, (path, field)


def test_diff_bands_cover_every_affected_release_exactly_once():
    assert set(PATCH.diffs) == set(DIFFS)
    for version in RELEASES:
        bands = [b for b in PATCH.diffs if SpecifierSet(b).contains(version)]
        assert len(bands) == (1 if _within(version, "0.11.0", "1.12.0") else 0), version


# ------------------------------------------------------------------------------------------------------------
# The framework extension: Target(..., releases=...) and Patch.targets_for / Patch.targets / gating.


def _moved_patch():
    return Patch(id="x/moved", summary="s", distribution="x", affected=">=1.0", fixed_in=None, apply=None,
                 targets=[Target("x.old", "f", {"a": "1.0"}, releases="<2.0"),
                          Target("x.new", "f", {"b": "2.0"}, releases=">=2.0"),
                          Target("x.common", "g", {"c": "1.0-2.0"})])


def _tree(tmp_path, files):
    paths = {}
    for module, body in files.items():
        path = tmp_path / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        paths[module] = str(path)
    return paths.get


def test_banded_targets_by_release():
    patch = _moved_patch()
    names = lambda targets: [t.module for t in targets]  # noqa: E731
    assert names(patch.targets_for("1.5")) == ["x.old", "x.common"]
    assert names(patch.targets_for("2.0")) == names(patch.targets_for("2.1.dev0")) == ["x.new", "x.common"]
    assert names(patch.targets_for(None)) == ["x.old", "x.new", "x.common"]
    assert names(patch.targets_for("not-a-version")) == ["x.common"]
    # distribution "x" is not installed: every target (the gate says "not installed")
    assert names(patch.targets) == ["x.old", "x.new", "x.common"] and patch.modules == ("x.old", "x.new", "x.common")


def test_targets_without_releases_are_unchanged():
    patch = Patch(id="x/plain", summary="s", distribution="x", affected=">=0", fixed_in=None, apply=None,
                  targets=[Target("x.a", "f", {"a": "1"}), Target("x.b", "g", {"b": "1"})])
    assert patch.targets == patch.all_targets == patch.targets_for("1.0") == patch.targets_for(None)
    assert all(t.releases is None for t in patch.targets)


def test_a_release_is_gated_on_its_own_targets_only(tmp_path):
    patch = _moved_patch()
    fp = {}
    for name, body in (("old", "def f():\n    return 1\n"), ("new", "def f():\n    return 2\n"),
                       ("common", "def g():\n    return 3\n")):
        fp[name] = gating.fingerprint_lines(body.splitlines())
    patch.all_targets[0].fingerprints = {fp["old"]: "1.0"}
    patch.all_targets[1].fingerprints = {fp["new"]: "2.0"}
    patch.all_targets[2].fingerprints = {fp["common"]: "1.0-2.0"}
    # an old release has no x.new, a new one no x.old: each is judged on what it has
    old = _tree(tmp_path / "old", {"x.old": "def f():\n    return 1\n", "x.common": "def g():\n    return 3\n"})
    new = _tree(tmp_path / "new", {"x.new": "def f():\n    return 2\n", "x.common": "def g():\n    return 3\n"})
    assert gating.evaluate(patch, version="1.5", locate=old)[1] == gating.APPLIES
    assert gating.evaluate(patch, version="2.0", locate=new)[1] == gating.APPLIES
    # a new release without the new module, or with other code there, is not one the patch knows
    _, verdict, reason = gating.evaluate(patch, version="2.0", locate=old)
    assert verdict == gating.DRIFTED and reason.startswith("x.new not found"), reason
    drifted = _tree(tmp_path / "drift", {"x.new": "def f():\n    return 20\n", "x.common": "def g():\n    return 3\n"})
    _, verdict, reason = gating.evaluate(patch, version="2.0", locate=drifted)
    assert verdict == gating.DRIFTED and "x.new:f differs" in reason, reason


def test_a_release_with_no_target_is_never_patched(tmp_path):
    patch = Patch(id="x/gone", summary="s", distribution="x", affected=">=0", fixed_in=None, apply=None,
                  targets=[Target("x.old", "f", {"a": "1.0"}, releases="<2.0")])
    _, verdict, reason = gating.evaluate(patch, version="2.0", locate=lambda module: None)
    assert verdict == gating.DRIFTED and "no code of x 2.0 is known to this patch" in reason, reason
