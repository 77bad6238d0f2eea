"""Every patch of the registry against every release of its package in the range it is checked on: the released
sources (sdists, or the wheel of a release published without one), read, never executed. One suite for all
patches; what is specific to a patch is what its reproducers declare in their Proof (releases_checked,
others_with_and_without) and, for what one patch alone needs, its own test module (tests marked unit_only).

For every release: the verdict is the one the declaration gives (fixed upstream / not affected / unsupported /
applies), and where it applies the release's own source has a recorded fingerprint, exactly one diff band covers
it and that diff applies to the release's files (`git apply --check`). For every patch: the recorded fingerprints
are exactly those of the releases it applies to, each with the right release range; the diff bands hold only
such releases and carry their DEP-3 fields; changing any one target's source makes it "drifted"; a build that is
not a plain release is judged by its source; a future release is judged as the bug's status upstream says (open:
by its source, so unchanged source gets the fix; fixed: by number).
"""
import os
import subprocess

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dspatch import data_dir, gating, registry
from dspatch import upstream

from upstream_releases import module_paths, named_releases, release_tree, release_versions, tree_locate

pytestmark = pytest.mark.unit_only

PATCHES = registry.all_patches()
# Declared beside each patch, in its reproducers module: the releases it is checked on (its package, first and last
# release), and for a patch that `requires` another package, versions of it with the bug's need and without.
CHECKED = {pid: patch.releases_checked for pid, patch in PATCHES.items() if patch.releases_checked}
OTHERS = {pid: patch.others_with_and_without for pid, patch in PATCHES.items() if patch.others_with_and_without}


def test_every_patch_is_checked():
    assert set(CHECKED) == set(PATCHES), f"no releases_checked in the Proof of {set(PATCHES) - set(CHECKED)}"


RELEASES = {pid: release_versions(PATCHES[pid].distribution, *CHECKED[pid]) for pid in CHECKED}


def _diff_paths(patch):
    """Repository paths every diff of the patch touches."""
    found = set()
    for relative in patch.diffs.values():
        with open(os.path.join(data_dir("upstream_prs"), relative)) as f:
            for line in f:
                if line.startswith(("--- a/", "+++ b/")):
                    found.add(line[6:].strip())
    return found


def _tree(pid, version):
    """(folder, locate) of the release's files this patch needs: its targets, its fixed marker, what its diffs
    touch."""
    patch = PATCHES[pid]
    modules = [t.module for t in patch.all_targets] + ([patch.fixed_marker[0]] if patch.fixed_marker else [])
    paths = {p for m in modules for p in module_paths(m)} | _diff_paths(patch)
    root = release_tree(patch.distribution, version, sorted(paths))
    return root, tree_locate(root)


def declared(patch, version, others):
    """The verdict the declaration gives a plain release (gating.evaluate's order), before any source is read."""
    v = Version(version)
    if patch.fixed_in and v >= Version(patch.fixed_in):
        return gating.FIXED_UPSTREAM
    if not SpecifierSet(patch.affected).contains(v):
        return gating.NOT_AFFECTED
    if any(others[other] is None or not SpecifierSet(wanted).contains(others[other])  # None: not installed
           for other, wanted in patch.requires.items()):
        return gating.NOT_AFFECTED
    if patch.supported and not SpecifierSet(patch.supported).contains(v):
        return gating.UNSUPPORTED
    return gating.APPLIES


def _audited(patch, version, others):
    from dspatch import audit

    pins = {patch.distribution: audit.Pin(patch.distribution, versions=[version])}
    pins.update({name: audit.Pin(name, versions=[v]) for name, v in others.items()})
    return audit.decide(patch, version, pins)


def _with_bug(pid):
    return OTHERS.get(pid, ({}, {}))[0]


def applying(pid):
    patch = PATCHES[pid]
    return [v for v in RELEASES[pid] if declared(patch, v, _with_bug(pid)) == gating.APPLIES]


@pytest.mark.parametrize("pid, version", [(pid, v) for pid in CHECKED for v in RELEASES[pid]])
def test_verdict_of_every_release(pid, version):
    patch = PATCHES[pid]
    root, locate = _tree(pid, version)
    with_bug, without = OTHERS.get(pid, ({}, {}))
    expected = declared(patch, version, with_bug)
    found = gating.evaluate(patch, version=version, locate=locate, others=with_bug)
    verdict, reason = found.verdict, found.reason
    assert verdict == expected, reason
    # `dspatch audit` gives that release, pinned, the verdict its source gets here, without reading it, and says
    # that its source was read where it applies
    audited, why = _audited(patch, version, with_bug)
    assert audited == verdict and (verdict != gating.APPLIES or "its released source is checked" in why), why
    if patch.requires:  # the other package decides too, and the reason says which version it saw
        found = gating.evaluate(patch, version=version, locate=locate, others=without)
        other_verdict, other_reason = found.verdict, found.reason
        assert other_verdict == declared(patch, version, without), other_reason
        assert _audited(patch, version, without)[0] == other_verdict
        if expected == gating.APPLIES:
            for other, wanted in patch.requires.items():
                seen = f"{without[other]} is installed" if without[other] else "is not installed"
                assert f"the bug needs {other}{wanted}; {other} {seen}" == other_reason
    if patch.fixed_marker and expected in (gating.APPLIES, gating.FIXED_UPSTREAM):
        module, qualname = patch.fixed_marker  # upstream's fix is there exactly where the number says so
        has_fix = locate(module) is not None and upstream.definition(locate(module), qualname) is not None
        assert has_fix == (expected == gating.FIXED_UPSTREAM), (module, qualname)
    if expected != gating.APPLIES:
        assert patch.diff_for(version) is None or not SpecifierSet(patch.supported or ">=0").contains(version)
        return
    for target in patch.targets_for(version):
        assert upstream.fingerprint(locate(target.module), target.qualname) in target.fingerprints, target
    diff = patch.diff_for(version)
    assert diff, f"no diff band covers {version}"
    check = subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), diff)], cwd=root,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("pid", list(CHECKED))
def test_recorded_fingerprints_are_exactly_the_released_ones(pid):
    """No stale entry, none missing, and each entry's release range is the releases that ship that source."""
    patch = PATCHES[pid]
    for target in patch.all_targets:
        have = [v for v in applying(pid) if target in patch.targets_for(v)]
        seen = {}
        for version in have:
            _, locate = _tree(pid, version)
            seen.setdefault(upstream.fingerprint(locate(target.module), target.qualname), []).append(version)
        assert set(seen) == set(target.fingerprints), (target, {fp: (v[0], v[-1]) for fp, v in seen.items()})
        for fingerprint, versions in seen.items():
            assert named_releases(target.fingerprints[fingerprint], have) == versions, (target, fingerprint, versions)


@pytest.mark.parametrize("pid", list(CHECKED))
def test_diff_bands_hold_only_releases_the_patch_applies_to(pid):
    patch = PATCHES[pid]
    applies = applying(pid)
    for version in applies:
        assert sum(SpecifierSet(band).contains(version) for band in patch.diffs) == 1, version
    for band, relative in patch.diffs.items():
        inside = [v for v in RELEASES[pid] if SpecifierSet(band).contains(v)]
        assert inside and set(inside) <= set(applies), (band, inside)
        text = open(os.path.join(data_dir("upstream_prs"), relative)).read()
        for field in ("From ", "Subject: ", "Description: ", "Forwarded: ", "Last-Update: ", f"dspatch-Id: {pid}"):
            assert field in text, (relative, field)
        assert "Bug: " in text or "Bug-" in text, relative
        if patch.fixed_in:
            applied = [line for line in text.splitlines() if line.startswith("Applied-Upstream: ")]
            assert len(applied) == 1 and patch.fixed_in in applied[0], (relative, applied)


def _changed(path, qualname):
    """The file with one statement added to the definition (a fork's or a dev build's change)."""
    node = upstream.definition(path, qualname)
    lines = open(path).read().split("\n")
    last = node.body[-1]
    lines.insert(last.lineno - 1, lines[last.lineno - 1][:last.col_offset] + "_local_change = None")
    return "\n".join(lines)


@pytest.mark.parametrize("pid", list(CHECKED))
def test_a_change_to_any_one_target_is_drifted(pid, tmp_path):
    patch = PATCHES[pid]
    newest = applying(pid)[-1]
    _, locate = _tree(pid, newest)
    later = [newest] + ([] if patch.fixed_in else [f"{newest}+g1234", _next(newest)])
    for target in patch.targets_for(newest):
        copy = tmp_path / target.qualname / os.path.basename(locate(target.module))
        copy.parent.mkdir()
        copy.write_text(_changed(locate(target.module), target.qualname))
        changed = lambda module: str(copy) if module == target.module else locate(module)  # noqa: E731
        for version in later:
            found = gating.evaluate(patch, version=version, locate=changed, others=_with_bug(pid))
            verdict, reason = found.verdict, found.reason
            assert verdict == gating.DRIFTED and str(target) in reason, (version, reason)


def _next(version):
    major, minor, micro = Version(version).release[:3]
    return f"{major}.{minor}.{micro + 1}"


@pytest.mark.parametrize("pid", list(CHECKED))
def test_builds_and_releases_beyond_the_checked_ones(pid):
    """A local or git build of a release with that release's source gets the patch; a future release is judged
    by its source while the bug is open upstream, by its number once it is fixed; an affected release older
    than the patch supports is 'unsupported'."""
    patch = PATCHES[pid]
    newest = applying(pid)[-1]
    _, locate = _tree(pid, newest)
    verdict = lambda version, where=locate: gating.evaluate(patch, version=version, locate=where,  # noqa: E731
                                                            others=_with_bug(pid)).verdict
    assert verdict(f"{newest}+local") == gating.APPLIES
    for version in filter(None, (patch.fixed_in, _next(newest), "999.0")):
        expected = declared(patch, version, _with_bug(pid))
        if expected == gating.APPLIES:  # open upstream: the source decides
            assert verdict(version) == gating.APPLIES and verdict(version, lambda m: None) == gating.DRIFTED
        else:
            assert verdict(version, lambda m: None) == expected
    if patch.supported:
        older = [v for v in release_versions(patch.distribution, "0", applying(pid)[0])
                 if SpecifierSet(patch.affected).contains(v) and not SpecifierSet(patch.supported).contains(v)]
        if not older and SpecifierSet(patch.affected).contains("0.0.1"):
            older = ["0.0.1"]  # no release on the index: an invented one
        for version in older[-1:]:
            assert verdict(version, lambda m: None) == gating.UNSUPPORTED, version
