"""`dspatch audit`: the known bugs a lock or requirements file's pins have, which dspatch fixes, and the smallest
upgrade that clears them all without dspatch. Before anything is installed: nothing of the pinned packages is
imported or needed, only their names and versions.

    dspatch audit requirements.txt [constraints.txt ...]     (-r/-c includes, markers, hashes; `pip freeze` output)
    dspatch audit uv.lock | poetry.lock | pylock.toml        (- reads standard input)
    dspatch audit --pins "deepspeed==0.16.9 transformers==4.46.3 torch==2.6.0"

Each patch gets the verdict `dspatch check` would give with those versions installed (applies, fixed upstream, not
affected, unsupported; "not pinned" where the pins do not name its package), decided from its declaration and from
the source of each release that the release suite read (tests/test_releases.py). A range pin gets the verdicts of
the releases it admits (dspatch.releases lists them). Known bugs no patch fixes (dspatch.known) are listed where
the pins have them. The upgrade it proposes minds what each release requires of the other pinned packages
(dspatch.requires, read from the released files).

Exit status (for CI): 0 when every known bug the pins have is fixed by a dspatch patch (or none is there); 1 when one
is there that no patch fixes (with --strict: when any known bug is there); 2 when an input cannot be read (which
line, and why).
"""
import argparse
import json
import os
import re
import sys

from dspatch import gating, registry
from dspatch.known import KNOWN, in_range
from dspatch.releases import RELEASES
from dspatch.requires import REQUIRES
from dspatch.versions import InvalidVersion, Specifier, SpecifierSet, Version

PRESENT, NOT_PINNED = "present", "not pinned"


class Unreadable(ValueError):
    """An input that cannot be read: the message says which file, which line, and why."""


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


class Pin:
    """What the inputs say of one package: `spec` (a PEP 440 specifier; "" for any release), or `versions` (the exact
    releases a lock file lists: more than one where it resolves per platform), and where it was read."""

    def __init__(self, name, spec="", versions=None, where=""):
        self.name, self.spec, self.versions, self.where = canonical(name), spec, list(versions or []), where

    @property
    def text(self):
        if self.versions:
            return " or ".join(f"=={v}" for v in self.versions)
        return self.spec or "(any release)"

    def releases(self):
        """The releases the pin admits: its exact versions, or those of dspatch.releases its range contains."""
        if self.versions:
            return list(self.versions)
        spec = SpecifierSet(self.spec)
        return [v for v in RELEASES.get(self.name, ()) if spec.contains(v)]

    def merged(self, other):
        """Both pins at once (a requirements file and its constraints): exact versions win, ranges add up; two
        different exact versions cannot both hold (pip would refuse them too)."""
        if self.versions and other.versions and self.versions != other.versions:
            raise Unreadable(f"{other.where}: {self.name}{other.text} conflicts with {self.name}{self.text} "
                             f"({self.where})")
        if self.versions or other.versions:
            exact = self if self.versions else other
            return Pin(self.name, versions=exact.versions, where=exact.where)
        spec = ",".join(s for s in (self.spec, other.spec) if s)
        return Pin(self.name, spec, where=f"{self.where}, {other.where}")


# ---- reading the inputs -------------------------------------------------------------------------------------------

_NAME = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[^\]]*\])?\s*(.*)$")
# pip options with a value that say nothing of a pin (a requirement line's own --hash/--config-settings included)
_IGNORED = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--trusted-host", "--no-binary",
            "--only-binary", "--use-feature", "--hash", "--config-settings", "-C", "--global-option")
_IGNORED_FLAGS = ("--pre", "--prefer-binary", "--require-hashes", "--no-index")
# what pip installs from a location given alone: a URL (git+https://..., https://.../x.whl), a path (./pkg, /x, ~/x),
# an archive or wheel file
_BARE_LOCATION = re.compile(r"^(?:[a-z][a-z0-9+.-]*://|[./~]|[A-Za-z]:[\\/])|\.(?:whl|zip|tar\.gz|tgz|tar\.bz2)$")


def _marker_holds(marker, where):
    """Whether an environment marker holds for this interpreter (pip's reading), or None where no marker parser is
    there (packaging, or pip's copy of it): then the pin is kept."""
    try:
        from packaging.markers import InvalidMarker, Marker
    except ImportError:
        try:
            from pip._vendor.packaging.markers import InvalidMarker, Marker
        except ImportError:
            return None
    try:
        return Marker(marker).evaluate()
    except InvalidMarker as e:
        raise Unreadable(f"{where}: invalid environment marker {marker!r}: {e}") from None


def requirement(text, where):
    """A Pin from one requirement (`name[extras] specifiers ; marker`, `name @ url`), or None when its marker does
    not hold here."""
    found = _NAME.match(text)
    if not found:
        raise Unreadable(f"{where}: not a requirement: {text.strip()!r}")
    name, _, rest = found.groups()
    rest, _, marker = rest.partition(";")
    if marker.strip() and _marker_holds(marker.strip(), where) is False:
        return None
    rest = rest.strip()
    if rest.startswith("@"):  # a direct reference (a URL, a path): no release number to judge
        return Pin(name, where=where)
    spec = rest.strip("()").replace(" ", "")
    if spec.startswith("===") and "," not in spec:  # arbitrary equality: that exact string
        return Pin(name, versions=[spec[3:]], where=where)
    parts = [p for p in spec.split(",") if p]
    for part in parts:
        try:
            Specifier(part)
        except (InvalidVersion, ValueError) as e:
            raise Unreadable(f"{where}: {name}: not a version specifier: {part!r} ({e})") from None
    if len(parts) == 1 and parts[0].startswith(("==", "===")) and "*" not in parts[0]:
        return Pin(name, versions=[parts[0].lstrip("=")], where=where)
    return Pin(name, ",".join(parts), where=where)


def _logical_lines(text):
    """(line number, text) of a requirements file: comments out, `\\` continuations joined."""
    held, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", line)
        if not held:
            start = number
        if line.endswith("\\"):
            held += line[:-1] + " "
            continue
        yield start, held + line
        held = ""
    if held:
        yield start, held


def _requirements(text, name, pins, seen):
    folder = os.path.dirname(os.path.abspath(name)) if name != "-" else os.getcwd()
    for number, line in _logical_lines(text):
        where = f"{name}:{number}"
        words = line.split()
        if not words:
            continue
        first = words[0]
        if first in ("-r", "--requirement", "-c", "--constraint") or \
                first.startswith(("-r", "-c", "--requirement=", "--constraint=")):
            target = first.split("=", 1)[1] if "=" in first else (first[2:] if first[:2] in ("-r", "-c") and
                                                                   len(first) > 2 else " ".join(words[1:2]))
            if not target:
                raise Unreadable(f"{where}: {first} names no file")
            _read_file(os.path.join(folder, target), pins, seen, where)
            continue
        if first in ("-e", "--editable") or first.startswith("--editable=") or _BARE_LOCATION.match(first):
            continue  # a checkout, a URL or a path of something: not a release
        if first.startswith("-"):
            option = first.split("=", 1)[0]
            if option in _IGNORED or option in _IGNORED_FLAGS:
                continue
            raise Unreadable(f"{where}: unknown option {option!r}")
        # a requirement, maybe followed by --hash=... options
        text_part = re.split(r"\s--?[a-zA-Z]", " " + line, maxsplit=1)[0].strip()
        found = requirement(text_part, where)
        if found:
            pins[found.name] = pins[found.name].merged(found) if found.name in pins else found


def _toml(text, name):
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise Unreadable(f"{name}: reading a TOML lock file needs Python >= 3.11 (or the tomli package)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Unreadable(f"{name}: not valid TOML: {e}") from None


def _lock(data, name, pins):
    """uv.lock and poetry.lock ([[package]]) and pylock.toml (PEP 751, [[packages]]): name and version of each."""
    entries = data.get("packages") if "lock-version" in data else data.get("package")
    if not isinstance(entries, list):
        raise Unreadable(f"{name}: a TOML file that is no lock file dspatch knows (uv.lock, poetry.lock, pylock.toml: "
                         f"no [[package]] or [[packages]] list)")
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise Unreadable(f"{name}: package entry {index + 1} has no name")
        version = entry.get("version")
        where = f"{name}: {entry['name']}"
        if version is None:  # a directory, a VCS checkout, the project itself: no release
            continue
        try:
            Version(str(version))
        except InvalidVersion:
            raise Unreadable(f"{where}: version {version!r} is not a PEP 440 version") from None
        key = canonical(entry["name"])
        versions = pins[key].versions if key in pins else []
        pins[key] = Pin(key, versions=sorted(set(versions) | {str(version)}, key=Version), where=where)


def _read_file(path, pins, seen, where=None):
    if path != "-" and os.path.abspath(path) in seen:
        return
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            seen.add(os.path.abspath(path))
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise Unreadable(f"{where + ': ' if where else ''}{path}: cannot read: {e}") from None
    base = os.path.basename(path)
    if base in ("uv.lock", "poetry.lock") or (base.startswith("pylock.") and base.endswith(".toml")) or \
            (path == "-" and re.match(r"\s*(#.*\n\s*)*(\[\[packages?\]\]|lock-version\s*=|version\s*=)", text)):
        _lock(_toml(text, path), path, pins)
    else:
        _requirements(text, path, pins, seen)


def read_pins(paths=(), pins_text=""):
    """{canonical name: Pin} from the files (requirements, constraints, `pip freeze`, uv.lock, poetry.lock,
    pylock.toml) and from `--pins` ("name==version ..."). Unreadable says where and why."""
    pins, seen = {}, set()
    for path in paths:
        _read_file(path, pins, seen)
    for number, text in enumerate(pins_text.split(), 1):  # a "what if": they replace what the files say
        found = requirement(text, f"--pins item {number}")
        if found:
            pins[found.name] = found
    return pins


# ---- verdicts -----------------------------------------------------------------------------------------------------

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


def _others(item, pins):
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
        having = [r for r in releases if _contains(wanted, r)]
        if having and len(having) < len(releases):
            notes.append(f"with {other} {_span(having)} of those {other}{pin.text} admits")
        ruled_out = ruled_out or bool(releases and not having)
        others[other] = having[0] if having else releases[0] if releases else "unpinned"
    return others, notes, ruled_out


def _contains(spec, version):
    try:
        return SpecifierSet(spec).contains(Version(version).base_version)
    except InvalidVersion:
        return True


def decide(patch, version, pins):
    """(verdict, reason) of a patch for one release of its package, with the other pins."""
    others, notes, _ = _others(patch, pins)
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
    return not _others(item, pins)[2]


def _span(versions):
    return versions[0] if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"


def _judge(verdicts, pin):
    """One verdict for a pin from those of the releases it admits: theirs when they agree; else "applies" (or
    "present"), saying which releases have the bug."""
    kinds = {}
    for release, (verdict, _) in verdicts.items():
        kinds.setdefault(verdict, []).append(release)
    if len(kinds) == 1:
        verdict, releases = next(iter(kinds.items()))
        if len(releases) == 1:
            return verdict, verdicts[releases[0]][1]
        return verdict, (f"every release {pin.name}{pin.text} admits ({_span(releases)}): {verdict}; "
                         f"{releases[-1]}: {verdicts[releases[-1]][1]}")
    buggy = next((v for v in (gating.UNSUPPORTED, PRESENT, gating.APPLIES) if v in kinds), None)  # worst first
    parts = "; ".join(f"{_span(r)}: {v}" for v, r in kinds.items())
    return buggy or next(iter(kinds)), f"of the releases {pin.name}{pin.text} admits, {parts}"


def audit(pins):
    """{"patches": [...], "unpatched": [...], "upgrade": {...}}: each patch's verdict, the known bugs without a
    patch that the pins have, and the smallest upgrade that clears every known bug without dspatch."""
    rows = []
    for patch in registry.all_patches().values():
        pin = pins.get(canonical(patch.distribution))
        row = {"id": patch.id, "distribution": patch.distribution, "pin": pin.text if pin else None,
               "fixed_in": patch.fixed_in, "effect": patch.summary}
        releases = pin.releases() if pin else []
        if not pin:
            row.update(verdict=NOT_PINNED, reason=f"{patch.distribution} is not pinned")
        elif not releases:
            row.update(verdict=NOT_PINNED, reason=f"no release of {patch.distribution} that dspatch knows matches "
                                                  f"{pin.text}")
        else:
            verdicts = {v: decide(patch, v, pins) for v in releases}
            row["verdict"], row["reason"] = _judge(verdicts, pin)
            if len(releases) > 1:
                row["releases"] = {v: verdict for v, (verdict, _) in verdicts.items()}
        rows.append(row)
    unpatched = []
    for known in KNOWN:
        pin = pins.get(canonical(known.distribution))
        releases = pin.releases() if pin else []
        having = [v for v in releases if has_bug(known, v, pins)]  # (Known.has, with the pins' ranges)
        if having:
            notes = _others(known, pins)[1]
            unpatched.append({"id": known.id, "distribution": known.distribution, "pin": pin.text,
                              "releases": having if len(releases) > 1 else None, "verdict": PRESENT,
                              "effect": known.effect, "affected": known.affected, "fixed_in": known.fixed_in,
                              "advice": known.advice, "links": list(known.links), "notes": notes})
    return {"patches": rows, "unpatched": unpatched, "upgrade": upgrade(pins)}


def requirements(name, version):
    """{other package: specifier} that release of `name` requires of the packages dspatch knows (dspatch.requires,
    read from the released files); nothing where dspatch has not read that release."""
    return REQUIRES.get(name, {}).get(Version(version).base_version, {})


def _conflicts(state, name, version):
    """Why release `version` of `name` cannot sit with the other exact pins of `state`: ("requires", other, spec)
    for each of its requirements an exact pin misses, ("required", other, spec) for each exact pin that requires of
    `name` what `version` is not."""
    found = []
    for other, spec in requirements(name, version).items():
        pin = state.get(other)
        if pin is not None and len(pin.releases()) == 1 and not _contains(spec, pin.releases()[0]):
            found.append(("requires", other, spec))
    for other, pin in state.items():
        if other != name and len(pin.releases()) == 1:
            spec = requirements(other, pin.releases()[0]).get(name)
            if spec and not _contains(spec, version):
                found.append(("required", other, spec))
    return found


def upgrade(pins):
    """For every known bug the pins have (a patch's or not), the first release that fixes it upstream; and the
    smallest upgrade of the exact pins that clears all of them without dspatch: per package, the lowest release at
    or above its pin where none of the bugs of that package (or that need it) is there, with the other packages
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
        for kind, other, spec in _conflicts(trial, name, version):
            if kind == "required":
                return None, {}
            fit = next((v for v in newer(trial, other) if _contains(spec, v)
                        and not _conflicts({**trial, other: Pin(other, versions=[v])}, other, v)), None)
            if fit is None:
                return None, {}
            trial[other], why[other] = Pin(other, versions=[fit]), (fit, f"{name} {version} requires {other}{spec}")
        return trial, why

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
                if trial is not None and all(i.id in before or clears(trial, i) for i in bugs(trial, needing)):
                    count = len(bugs(trial, own))
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


# ---- output -------------------------------------------------------------------------------------------------------

def exit_status(report, strict=False):
    fixed_by_patch = [r for r in report["patches"] if r["verdict"] == gating.APPLIES]
    unfixed = [r for r in report["patches"] if r["verdict"] == gating.UNSUPPORTED] + report["unpatched"]
    return 1 if unfixed or (strict and fixed_by_patch) else 0


def _lines(report, pins, sources, verbose):
    out = [f"dspatch audit: {', '.join(sources)}: {len(pins)} packages pinned"]
    for name in ("deepspeed", "transformers", "accelerate", "trl", "peft", "torch"):
        if name in pins:
            out[-1] += f"; {name}{pins[name].text}" if not pins[name].versions else \
                f"; {name} {' or '.join(pins[name].versions)}"
    applies = [r for r in report["patches"] if r["verdict"] == gating.APPLIES]
    unsupported = [r for r in report["patches"] if r["verdict"] == gating.UNSUPPORTED]
    width = max((len(r["id"]) for r in report["patches"]), default=0)
    out += ["", f"Known bugs these pins have that dspatch fixes ({len(applies)}): DSPATCH=1 applies the patch"]
    out += [f"  {r['id']:<{width}}  {r['reason']}" for r in applies] or ["  none"]
    if unsupported:
        out += ["", f"Known bugs these pins have that the patch is not written for ({len(unsupported)}):"]
        out += [f"  {r['id']:<{width}}  {r['reason']}" for r in unsupported]
    out += ["", f"Known bugs these pins have that dspatch does not patch ({len(report['unpatched'])}):"]
    for k in report["unpatched"]:
        fix = f"fixed in {k['distribution']} {k['fixed_in']}" if k["fixed_in"] else "open upstream"
        which = f" ({_span(k['releases'])} of the pin)" if k["releases"] else ""
        out += [f"  {k['id']}{which}: {k['effect']}; {fix}; meanwhile: {k['advice']}"]
    if not report["unpatched"]:
        out += ["  none"]
    rest = [r for r in report["patches"] if r["verdict"] not in (gating.APPLIES, gating.UNSUPPORTED)]
    if verbose:
        out += ["", "The other patches:"] + [f"  {r['id']:<{width}}  {r['verdict']}: {r['reason']}" for r in rest]
    else:
        counts = {}
        for r in rest:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        out += ["", "The other patches: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + " (-v: each)"]
    up = report["upgrade"]
    out += ["", "Upgrading instead:"]
    if up["per_bug"]:
        fixed = {bug: first for bug, first in up["per_bug"].items() if first}
        out += [f"  {bug.split('/')[0]} {first} clears {bug}" for bug, first in
                sorted(fixed.items(), key=lambda item: (item[0].split("/")[0], Version(item[1])))]
        if up["to"]:
            out += ["  the smallest upgrade that clears them without dspatch: " +
                    ", ".join(f"{n} {a} -> {b}" for n, (a, b) in sorted(up["to"].items()))]
            out += [f"    {n} moves because {why}" for n, why in sorted(up["because"].items())]
        if up["not_cleared"]:
            out += [f"  it leaves (no release of their package is free of all at once): {', '.join(up['not_cleared'])}"]
        if up["introduced"]:
            out += [f"  it brings in (the pins do not have them): {', '.join(up['introduced'])}"]
        if up["open"]:
            out += [f"  no release clears these yet: {', '.join(up['open'])}"]
    else:
        out += ["  none needed: the exact pins have no known bug"]
    if up["ranges_not_considered"]:
        out += [f"  (range pins not upgraded: {', '.join(up['ranges_not_considered'])}; pin exact versions to get one)"]
    return out


DESCRIPTION = ("The known bugs a lock or requirements file's pins have (before installing), which dspatch fixes, and "
               "the smallest upgrade that clears them.")
EPILOG = ("Exit 0 when the pins have no known bug dspatch cannot fix (1 with --strict when they have any), 1 when they "
          "have one it cannot, 2 for a file it cannot read. docs/audit.md has the formats.")


def arguments(parser):
    parser.add_argument("files", nargs="*", metavar="FILE", help="requirements/constraints files, `pip freeze` "
                        "output, uv.lock, poetry.lock, pylock.toml (- for standard input)")
    parser.add_argument("-r", "--requirement", dest="more", action="append", default=[], metavar="FILE",
                        help="a requirements file, as pip takes it (the same as FILE)")
    parser.add_argument("-c", "--constraint", dest="more", action="append", metavar="FILE",
                        help="a constraints file, as pip takes it: its pins count as pins")
    parser.add_argument("--pins", default="", help='pins given inline: "deepspeed==0.16.9 torch==2.6.0"')
    parser.add_argument("--json", action="store_true", help="one JSON object (docs/audit.md)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any known bug is there, patched or not")
    parser.add_argument("-v", "--verbose", action="store_true", help="every patch's verdict and reason")
    return parser


def command(args, prog="dspatch audit"):
    files = [*args.files, *args.more]
    if not files and not args.pins:
        print(f"usage: {prog} FILE... [-c FILE] [--pins PINS] [--json] [--strict] [-v]\n{prog}: give a file or "
              f"--pins", file=sys.stderr)
        return 2
    try:
        pins = read_pins(files, args.pins)
    except Unreadable as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    report = audit(pins)
    code = exit_status(report, args.strict)
    if args.json:
        body = {"inputs": files + (["--pins"] if args.pins else []),
                "pins": {n: {"spec": p.spec or None, "versions": p.versions or None, "where": p.where}
                         for n, p in sorted(pins.items())}, **report, "exit": code}
        print(json.dumps(body, indent=1))
    else:
        from dspatch import term

        term.out(_lines(report, pins, files + (["--pins"] if args.pins else []), args.verbose))
    return code


def main(argv=None, prog="python -m dspatch.audit"):
    parser = arguments(argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG))
    return command(parser.parse_args(argv), prog)


if __name__ == "__main__":
    from dspatch import term

    term.exit_with(main)
