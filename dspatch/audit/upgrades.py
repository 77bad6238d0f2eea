"""The smallest upgrade of the pins that clears every known bug without dspatch, minding what each release requires
of the other pinned packages (dspatch.requires)."""

from dspatch import registry
from dspatch.known import KNOWN
from dspatch.releases import RELEASES
from dspatch.requires import REQUIRES
from dspatch.versions import Version

from dspatch.audit.pins import Pin, canonical
from dspatch.audit.verdicts import spec_contains, has_bug


def requirements(name, version):
    """{other package: specifier} that release of `name` requires of the packages dspatch knows (dspatch.requires,
    read from the released files); nothing where dspatch has not read that release."""
    return REQUIRES.get(name, {}).get(Version(version).base_version, {})


def pin_conflicts(state, name, version):
    """Why release `version` of `name` cannot sit with the other exact pins of `state`: ("requires", other, spec)
    for each of its requirements an exact pin misses, ("required", other, spec) for each exact pin that requires of
    `name` what `version` is not."""
    found = []
    for other, spec in requirements(name, version).items():
        pin = state.get(other)
        if pin is not None and len(pin.releases()) == 1 and not spec_contains(spec, pin.releases()[0]):
            found.append(("requires", other, spec))
    for other, pin in state.items():
        if other != name and len(pin.releases()) == 1:
            spec = requirements(other, pin.releases()[0]).get(name)
            if spec and not spec_contains(spec, version):
                found.append(("required", other, spec))
    return found


def upgrade(pins):
    """For every known bug the pins have (a patch's or not), the first release that fixes it upstream; and the
    smallest upgrade of the exact pins that clears all of them without dspatch: per package, the lowest release at
    or above its pin where none of the bugs of that package (or that need it) is there (a bug no release fixes yet
    does not count against a release: no upgrade avoids it for good, and a move that brings it in says so, as
    introduced), with the other packages
    as chosen, until nothing changes (a bug a move brings into another package is allowed where a release of that
    package clears it: the next round moves it). A release whose requirements an exact pin of another package misses
    takes that package along, to its lowest release that meets them (trl 1.16.0 needs transformers >= 4.56.2); one
    that another pin rules out (its own requirement) is passed over."""
    items = [*registry.all_patches().values(), *KNOWN]
    exact = {name for name, pin in pins.items() if len(pin.releases()) == 1}
    ranged = sorted({canonical(i.distribution) for i in items} & (set(pins) - exact))

    def release(state, name):
        return state[name].releases()[0]

    def bugs(state, among=items):
        return [i for i in among if canonical(i.distribution) in exact
                and has_bug(i, release(state, canonical(i.distribution)), state)]

    def newer(state, name):
        current = Version(release(state, name)).base_version
        return [v for v in RELEASES.get(name, ()) if Version(v) >= Version(current)]

    def moved(state, name, version):
        """`state` with `name` at `version` and what its requirements take along, or None where that cannot be
        (another pin rules it out, or no release of a package it needs meets the requirement and sits with the
        rest); the reasons, {package taken along: why}."""
        trial, why = {**state, name: Pin(name, versions=[version])}, {}
        for kind, other, spec in pin_conflicts(trial, name, version):
            if kind == "required":
                return None, {}
            fit = next((v for v in newer(trial, other) if spec_contains(spec, v)
                        and not pin_conflicts({**trial, other: Pin(other, versions=[v])}, other, v)), None)
            if fit is None:
                return None, {}
            trial[other], why[other] = Pin(other, versions=[fit]), (fit, f"{name} {version} requires {other}{spec}")
        return trial, why

    def open_upstream(state, item):
        """Whether the newest release of the item's package still has it (with the rest of `state`): no move of that
        package clears it, so a move of another package that brings it in is not ruled out by it (it is said, as
        introduced)."""
        name = canonical(item.distribution)
        newest = max(RELEASES.get(name, ()) or [release(state, name)], key=Version)
        return has_bug(item, newest, {**state, name: Pin(name, versions=[newest])})

    def clears(state, item):
        """Whether a release of the item's package at or above its pin in `state` is free of it (with the rest of
        `state`): a bug a move brings into another package, that a move of that package takes out again."""
        name = canonical(item.distribution)
        return any(not has_bug(item, v, {**state, name: Pin(name, versions=[v])}) for v in newer(state, name))

    # each bug alone: the first release of its package at or above the pin without it, or none yet
    per_bug = {}
    for item in bugs(pins):
        name = canonical(item.distribution)
        per_bug[item.id] = next((v for v in newer(pins, name)
                                 if not has_bug(item, v, {**pins, name: Pin(name, versions=[v])})), None)
    open_ids = {bug for bug, first in per_bug.items() if first is None}
    clearable = [i for i in items if i.id not in open_ids]
    state, because = dict(pins), {}
    for _ in range(6):  # a package moved may bring in, or clear, a bug of another that needs it
        changed = False
        for name in sorted({canonical(i.distribution) for i in bugs(state, clearable)}):
            own = [i for i in clearable if canonical(i.distribution) == name]
            needing = [i for i in clearable if name in map(canonical, i.requires)]  # another package's bugs
            before = {i.id for i in bugs(state, needing)}
            best = None  # the lowest release with the fewest of its own bugs (none, where one clears them all)
            for candidate in newer(state, name):
                trial, why = moved(state, name, candidate)
                if trial is not None and all(i.id in before or clears(trial, i) or open_upstream(trial, i)
                                             for i in bugs(trial, needing)):
                    count = len([i for i in bugs(trial, own) if not open_upstream(trial, i)])
                    if best is None or count < best[0]:
                        best = (count, candidate, trial, why)
                    if not count:
                        break
            if best and best[1] != release(state, name):
                state, changed = best[2], True
                because.update(best[3])
        if not changed:
            break
    moves = {name: [release(pins, name), release(state, name)] for name in exact
             if release(state, name) != release(pins, name)}
    final = {i.id for i in bugs(state, items)}
    left = sorted(final & set(per_bug) - open_ids)  # no release of their package is free of all of them at once
    introduced = sorted(final - set(per_bug))  # bugs the upgraded releases have that the pins do not
    # a package taken along by another's requirement, where it stays at the release that requirement took it to
    said = {n: text for n, (fit, text) in because.items() if n in moves and moves[n][1] == fit}
    return {"per_bug": per_bug, "to": moves, "because": said,
            "open": sorted(open_ids), "not_cleared": left, "introduced": introduced, "ranges_not_considered": ranged}

