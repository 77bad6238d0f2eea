"""Each patch's verdict for the pinned releases, as `dspatch check` would give it with them installed, decided from
its declaration and the released sources the release suite read."""

from dspatch import gating
from dspatch.known import in_range
from dspatch.versions import InvalidVersion, SpecifierSet, Version

from dspatch.audit.pins import canonical

PRESENT, NOT_PINNED = "present", "not pinned"


class _NoSource(Exception):
    pass


def _no_source(module):
    raise _NoSource(module)


def _read_by_release_suite(patch, version):
    """Whether the source of every target of this release is one the patch declares for it by name (the unit
    session checks each declaration against the released sdist)."""
    targets = patch.targets_for(version)
    return bool(targets) and all(any(_names(releases, version) for releases in t.fingerprints.values())
                                 for t in targets)


def _names(text, version):
    """Whether a fingerprint table's releases ("0.14.0-0.15.3", "0.16.3", ranges separated by commas) name it."""
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if Version(low) <= Version(version) <= Version(high or low):
            return True
    return False


def other_releases(item, pins):
    """({distribution: a release for gating, of those the pins admit: one the bug needs where there is one}, notes,
    whether the pins rule the bug out) for the packages the bug also needs."""
    others, notes, ruled_out = {}, [], False
    for other, wanted in item.requires.items():
        pin = pins.get(canonical(other))
        if pin is None:
            others[other] = "unpinned"  # not a version: gating cannot tell, and the bug is taken as there
            notes.append(f"if {other}{wanted} ({other} is not pinned)")
            continue
        releases = pin.releases()
        having = [r for r in releases if spec_contains(wanted, r)]
        if having and len(having) < len(releases):
            notes.append(f"with {other} {release_span(having)} of those {other}{pin.text} admits")
        ruled_out = ruled_out or bool(releases and not having)
        others[other] = having[0] if having else releases[0] if releases else "unpinned"
    return others, notes, ruled_out


def spec_contains(spec, version):
    try:
        return SpecifierSet(spec).contains(Version(version).base_version)
    except InvalidVersion:
        return True


def decide(patch, version, pins):
    """(verdict, reason) of a patch for one release of its package, with the other pins."""
    others, notes, _ = other_releases(patch, pins)
    try:
        found = gating.evaluate(patch, version, locate=_no_source, others=others)
    except _NoSource:  # only the source can tell: what the release suite read of this release decides
        if str(Version(version)) != Version(version).base_version:
            reason = f"{patch.distribution} {version} is a build, not a release: at run time its source decides"
        elif _read_by_release_suite(patch, version):
            reason = f"{patch.distribution} {version} has the bug; its released source is checked"
        else:
            reason = (f"{patch.distribution} {version} has the bug by its number, from a source dspatch has not "
                      f"read: at run time the patch applies only if that source is one it knows")
        return gating.APPLIES, "; ".join([reason, *notes])
    if found.rule == "requires":
        (other, _), = found.seen.items()
        return found.verdict, f"the bug needs {found.bound}; the pins give {other}{pins[canonical(other)].text}"
    return found.verdict, found.reason


def has_bug(item, version, pins):
    """Whether release `version` of the item's package has the bug (a patch's or a known one) by the numbers alone,
    with the other pins: upstream's code, no dspatch."""
    try:
        if not in_range(item, version):
            return False
    except InvalidVersion:  # no release number: taken as having it
        return True
    return not other_releases(item, pins)[2]


def release_span(versions):
    return versions[0] if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"


def judge_pin(verdicts, pin):
    """One verdict for a pin from those of the releases it admits: theirs when they agree; else "applies" (or
    "present"), saying which releases have the bug."""
    kinds = {}
    for release, (verdict, _) in verdicts.items():
        kinds.setdefault(verdict, []).append(release)
    if len(kinds) == 1:
        verdict, releases = next(iter(kinds.items()))
        if len(releases) == 1:
            return verdict, verdicts[releases[0]][1]
        return verdict, (f"every release {pin.name}{pin.text} admits ({release_span(releases)}): {verdict}; "
                         f"{releases[-1]}: {verdicts[releases[-1]][1]}")
    buggy = next((v for v in (gating.UNSUPPORTED, PRESENT, gating.APPLIES) if v in kinds), None)  # worst first
    parts = "; ".join(f"{release_span(r)}: {v}" for v, r in kinds.items())
    return buggy or next(iter(kinds)), f"of the releases {pin.name}{pin.text} admits, {parts}"

