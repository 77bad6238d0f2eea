"""The upstream diffs of the bands no stack of the matrix installs, proven on a real release of each band (old
session): stock shows the bug on that release's own source, and the band's diff applied to it fixes it. A session
outside the matrix (ds0183) does the same for its patches' bands on their newest release, the monkeypatch too. (Split
from test_proofs.py so that pytest-xdist's workers share the proofs.)"""
import json
import os

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import OUTSIDE_MATRIX, STACK, _succeeded, clean_env, last_json, run_python, verify
from test_proofs import APPLICABLE

pytestmark = pytest.mark.stack


def _pinned(pins, distribution):
    """The versions `pins` ("name==version" strings) give `distribution`."""
    return [pin.split("==")[1] for pin in pins if pin.startswith(distribution + "==")]


def _matrix_versions(distribution, patch=None):
    """Versions of `distribution` some stack of the matrix installs (noxfile passes DSPATCH_MATRIX); with `patch`, only
    on the stacks whose other packages are those its bug needs (`requires`): on the others it does not apply."""
    stacks = json.loads(os.environ.get("DSPATCH_MATRIX", "{}"))
    return sorted({v for pins in stacks.values() for v in _pinned(pins, distribution)
                   if patch is None or _meets_requires(patch, pins)})


def _meets_requires(patch, pins):
    """Whether `pins` give the other packages `patch` requires a version it needs (one they do not name, torch, is
    not held against them)."""
    from packaging.specifiers import SpecifierSet

    return all(SpecifierSet(wanted).contains(v) for other, wanted in patch.requires.items()
               for v in _pinned(pins, other))


def _declared(target, version):
    """The fingerprint the patch declares for `version`'s source of `target` (the unit session checks every
    declaration against the released sources), or None where no entry names that release."""
    from upstream_releases import named_releases

    return next((fingerprint for fingerprint, releases in target.fingerprints.items()
                 if named_releases(releases, [version])), None)


def _target_code(patch, version, into):
    """The fingerprints of a release's targets (its code, as the gate sees it): as declared (collection on two
    workers read ~30 s of sdists otherwise), from its sdist where no declaration names that release."""
    targets = patch.targets_for(version)  # those that release has (code moved between modules across releases)
    declared = tuple((str(t), _declared(t, version)) for t in targets)
    if all(fingerprint for _, fingerprint in declared):
        return declared
    from upstream_releases import extract_modules

    locate = extract_modules(patch.distribution, version, patch.modules, os.path.join(into, version))
    return tuple((str(t), upstream.fingerprint(locate(t.module), t.qualname) if locate(t.module) else None)
                 for t in targets)


def _bands_no_stack_runs():
    """(pid, band, release, reason to skip or None) for the diff bands that no stack of the matrix installs.
    A band runs on the released source of its newest release, with the rest of the old stack, unless the code
    of its targets is that of a release a stack runs, or of a band already run here (then only the diff's
    context differs, which the unit session checks with `git apply --check` on every release)."""
    import tempfile

    from packaging.specifiers import SpecifierSet

    from upstream_releases import sdist_versions

    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for pid in APPLICABLE:
            patch = registry.all_patches()[pid]
            releases = sdist_versions(patch.distribution, "0.0", "999")
            # releases a stack runs where the patch applies (there the stack proves the diff), in the same order on
            # every worker
            covered = [v for v in releases if v in _matrix_versions(patch.distribution, patch)
                       and SpecifierSet(patch.affected).contains(v) and SpecifierSet(patch.supported).contains(v)]
            seen = {}
            for v in covered:
                seen.setdefault(_target_code(patch, v, tmp), f"{patch.distribution} {v}, which a stack runs")
            for band in patch.diffs:
                in_band = [v for v in releases if SpecifierSet(band).contains(v)]
                if not in_band or any(SpecifierSet(band).contains(v) for v in covered):
                    continue
                owner = _small_session_running(pid, patch.distribution, band)
                if owner:  # there with the monkeypatch too, on the installed release and the band's newest
                    found.append((pid, band, in_band[-1], f"the {owner} session runs this band"))
                    continue
                code = _target_code(patch, in_band[-1], tmp)
                same = seen.get(code)
                found.append((pid, band, in_band[-1], same and (
                    f"{in_band[-1]}'s targets are the code of {same}: only the diff's context differs "
                    f"(`git apply --check` on every release of the band, unit session)")))
                seen.setdefault(code, f"{patch.distribution} {in_band[-1]}, run for band {band}")
    return found


def _other_releases_of_this_sessions_bands():
    """On a session outside the matrix (one band's patches, as ds0183): the newest release of each diff band of the
    patches that apply here, where it is not the release installed (that one the session's own proofs run). There the
    monkeypatch is proven too: the session exists for these patches, and their targets' code differs across a band."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from upstream_releases import sdist_versions

    found = []
    for pid in APPLICABLE:
        patch = registry.all_patches()[pid]
        installed = gating.evaluate(patch).version
        releases = sdist_versions(patch.distribution, "0.0", "999")
        elsewhere = _other_small_sessions_install(patch.distribution)
        for band in patch.diffs:
            in_band = [v for v in releases if SpecifierSet(band).contains(v)]
            # each band once: it belongs to the small session whose installed release in it is the newest (where no
            # session installs one, to each session the patch applies to)
            holders = [v for v in in_band if v in elsewhere or v == installed]
            owner = max(holders, key=Version) if holders else None
            if owner is None and (any(v in _matrix_versions(patch.distribution, patch) for v in in_band)
                                  or _old_session_runs_bands(patch)):
                continue  # a full stack installs a release of it, or the old session runs it
            if in_band and in_band[-1] != installed and owner in (None, installed):
                found.append((pid, band, in_band[-1], None))
    return found


def _old_session_runs_bands(patch):
    """Whether the old session runs this patch's bands that no stack installs (it applies to the old stack's
    release, with the other packages it requires there as pinned; see _bands_no_stack_runs)."""
    from packaging.specifiers import SpecifierSet

    old = json.loads(os.environ.get("DSPATCH_MATRIX", "{}")).get("old", [])
    return _meets_requires(patch, old) and any(SpecifierSet(patch.affected).contains(v)
                                and SpecifierSet(patch.supported or ">=0").contains(v)
                                for v in _pinned(old, patch.distribution))


def _small_session_running(pid, distribution, band):
    """The session outside the matrix that proves `band` of patch `pid`: one that installs a release of the band and
    that proves the patch (noxfile passes DSPATCH_SMALL; the patch's Proof names the sessions that prove it,
    proven_in); None where none does."""
    from packaging.specifiers import SpecifierSet

    small = json.loads(os.environ.get("DSPATCH_SMALL", "{}"))
    proven_in = registry.all_patches()[pid].proven_in
    for name, pins in small.items():
        if any(SpecifierSet(band).contains(v) for v in _pinned(pins, distribution)) and name in proven_in:
            return name
    return None


def _other_small_sessions_install(distribution):
    """The releases of `distribution` the other sessions outside the matrix install (noxfile passes DSPATCH_SMALL)."""
    small = json.loads(os.environ.get("DSPATCH_SMALL", "{}"))
    return {v for name, pins in small.items() if name != STACK for v in _pinned(pins, distribution)}


BANDS = (_bands_no_stack_runs() if STACK == "old" else _other_releases_of_this_sessions_bands() if OUTSIDE_MATRIX
         else [])


@pytest.mark.parametrize("pid, band, version, same_code", BANDS or [("none", "", "", None)])
def test_diff_bands_no_stack_installs_fix_a_real_release_of_the_band(pid, band, version, same_code, tmp_path):
    """Stock shows the bug on that release's own source (the patch's `band_check` reproducer), and the band's
    diff applied to it fixes it."""
    import subprocess
    import tarfile

    from dspatch import data_dir

    from upstream_releases import sdist

    if pid == "none":
        pytest.skip("run on the old stack (the oldest dependencies of the matrix) and on sessions outside the matrix")
    if same_code:
        pytest.skip(same_code)
    patch = registry.all_patches()[pid]
    top = patch.modules[0].split(".")[0]
    with tarfile.open(sdist(patch.distribution, version)) as tar:
        # the package, at the top of the sdist or under src/ (accelerate, transformers); the diffs use the same paths
        members = [m for m in tar.getmembers() if m.name.split("/", 1)[-1].split("/")[0] == top
                   or m.name.split("/", 1)[-1].startswith(f"src/{top}/")]
        tar.extractall(tmp_path, members=members, filter="tar")
    root = next(tmp_path.iterdir())
    site = root / "src" if (root / "src" / top).is_dir() else root
    if OUTSIDE_MATRIX:  # the monkeypatch is gated on the release it sees: this one's, not the installed metadata's
        info = site / f"{patch.distribution}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {patch.distribution}\nVersion: {version}\n")
    # the first run writes the release's bytecode into the tree, the run after the diff compiles only what it changed
    env = {k: v for k, v in clean_env(PYTHONPATH=str(site)).items() if k != "PYTHONDONTWRITEBYTECODE"}
    name = patch.band_check
    run = run_python(["-m", "dspatch.verify", pid, "--only", name], env=env, check=False, warm="stack")
    stock = last_json(run) if run.returncode == 0 else None
    if stock is None or stock["results"][name].startswith("error:"):
        # where the release cannot be imported here, that band is proven by fingerprint and `git apply` only (said in
        # the skip); an import probe tells, run only then
        probe = run_python(["-c", f"import {top}"], env=env, check=False, warm="stack")
        if probe.returncode:
            pytest.skip(f"{patch.distribution} {version} cannot be imported with this stack's torch: "
                        f"{probe.stderr.strip().splitlines()[-1][:200]}")
        _succeeded(["-m", "dspatch.verify", pid, "--only", name], run)  # it imports: the reproducer's own failure
    if "torch._C' has no attribute '_cuda" in stock["results"][name]:  # accelerate < 0.25 with DeepSpeed
        pytest.skip(f"{patch.distribution} {version} runs this reproducer on CUDA only (this torch is a CPU "
                    f"build): that band is proven by fingerprint and `git apply` only")
    assert patch.expected_on_stock[name] in stock["results"][name], (version, name, stock["results"][name])
    if OUTSIDE_MATRIX:
        patched = verify(pid, {**env, "DSPATCH": pid}, "--only", name)
        assert patched["applied"] == [pid] and patched["results"] == {name: "ok"}, (version, patched)
    subprocess.run(["git", "apply", os.path.join(data_dir("upstream_prs"), patch.diffs[band])], cwd=root, check=True)
    fixed = verify(pid, env, "--only", name)
    assert fixed["applied"] == [] and fixed["results"] == {name: "ok"}, (version, fixed)
