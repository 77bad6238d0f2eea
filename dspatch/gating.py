"""Verdicts: does a patch belong in this environment? Decided from installed metadata and source files only
(dspatch.upstream reads them).

Nothing here imports torch or a target package (`--check` must be cheap and must work when a target is
broken or absent). The runtime uses the same functions on the files of the modules it is about to patch,
so `--check` and what happens in a training job cannot disagree.
"""
from __future__ import annotations

from dspatch.upstream import fingerprint, installed_version, module_file, source_segment

TYPE_CHECKING = False  # typing is not imported for this (mypy reads the names below)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from dspatch.spec import Patch


APPLIES = "applies"
APPLIED = "applied"
FIXED_UPSTREAM = "fixed upstream"
NOT_AFFECTED = "not affected"
NOT_INSTALLED = "not installed"
DRIFTED = "drifted"
DISABLED = "disabled"
UNSUPPORTED = "unsupported"
FAILED = "failed"
BROKEN = "broken install"


class Row:
    """One patch's row of `dspatch check`: `found` (its Verdict in this environment), and what decides in the end:
    `verdict` and `reason` (this process's state, the selection, or `found`'s), `disabled_by` (why the selection
    leaves it out, or None)."""

    def __init__(self, patch, found, verdict=None, reason=None, disabled_by=None):
        self.patch, self.found, self.disabled_by = patch, found, disabled_by
        self.version = found.version
        self.verdict = found.verdict if verdict is None else verdict
        self.reason = found.reason if reason is None else reason

    def as_dict(self):
        p = self.patch
        return {"id": p.id, "distribution": p.distribution, "version": self.version, "verdict": self.verdict,
                "reason": self.reason, "found": self.found.as_dict(), "disabled_by": self.disabled_by,
                "summary": p.summary, "affected": p.affected, "fixed_in": p.fixed_in,
                "supported": p.supported, "note": p.note,
                "links": list(p.links), "diffs": dict(p.diffs)}


def _source_mismatch(patch, locate, version=None):
    """None when every target's source (of release `version`'s targets) is a released one the patch knows; else
    why not."""
    targets = patch.targets_for(version)
    if not targets:
        return f"no code of {patch.distribution} {version} is known to this patch (none of its targets' releases)"
    for target in targets:
        path = locate(target.module)
        if path is None:
            return f"{target.module} not found in the installed {patch.distribution}"
        try:
            found = fingerprint(path, target.qualname)
        except Exception as e:
            import tokenize  # only here: a warm --check imports neither it nor the re it loads

            if not isinstance(e, (OSError, SyntaxError, UnicodeDecodeError, tokenize.TokenError)):
                raise
            return f"cannot read {path}: {e}"
        if found is None:
            return f"{target} is missing from {path}"
        if found not in target.fingerprints:
            return (f"{target} differs from every release this patch was written for (fingerprint {found}): "
                    f"a fork, a dev build or a modified install")
    return None


# The sentence of each rule that needs nothing but the distribution {d}, its version {v} and the bound {b}.
_SENTENCES = {
    "absent": "{d} is not installed",
    "version": "{d} version {v!r} is not a PEP 440 version; left out",
    "release": "fixed upstream in {b}",
    "range": "the bug affects {d} {b} only",
    "supported": "{d} {v} has the bug, but this patch is written and tested for {b} only; left out",
    "build fix": "{v} is a build that contains upstream's fix ({b})",
    "build number": "fixed upstream in {b} ({v} is a build at or past it, and its source is not that of an affected "
                    "release)",
}


class Verdict:
    """What the environment says of one patch: `verdict` (APPLIES, FIXED_UPSTREAM, ...), for `distribution` at
    `version`, decided by `rule` (which check decided: "release", "range", "requires", "supported", "source",
    "build fix", "build number", "version", "files", "absent") against `bound` (the range, release or requirement
    it compared with), having seen `seen` ({distribution: version} of the other packages the bug needs, or
    {"files": path}) and `mismatch` (why the source is not one the patch knows). `reason` is the sentence every
    output shows; `dspatch check`'s short column, its JSON and `explain` read the fields, never the sentence."""

    __slots__ = ("patch", "verdict", "version", "rule", "bound", "seen", "mismatch", "plain")

    def __init__(self, patch, verdict, version, rule, bound="", seen=None, mismatch="", plain=True):
        self.patch, self.verdict, self.version, self.rule, self.bound = patch, verdict, version, rule, bound
        self.seen, self.mismatch, self.plain = dict(seen or {}), mismatch, plain

    @property
    def distribution(self):
        return self.patch.distribution

    def __repr__(self):
        return f"Verdict({self.patch.id}: {self.verdict}, {self.distribution} {self.version}: {self.reason})"

    @property
    def reason(self):
        d, v, b = self.distribution, self.version, self.bound
        if self.rule in _SENTENCES:
            return _SENTENCES[self.rule].format(d=d, v=v, b=b)
        if self.rule == "files":
            return (f"{d}'s files are installed ({self.seen['files']}) but its metadata (dist-info) is missing or "
                    f"unreadable, so its release cannot be told; left out")
        if self.rule == "requires":
            (other, seen), = self.seen.items()
            return f"the bug needs {b}; {other} {seen + ' is installed' if seen else 'is not installed'}"
        if self.rule == "source" and self.verdict == APPLIES:
            note = "" if self.plain else ", and its source is that of a released version with the bug"
            note += "".join(f", with {other} {seen} (the bug needs {other}{self.patch.requires[other]})"
                            for other, seen in self.seen.items())
            return f"{d} {v} has the bug ({b}){note}"
        return f"{self.mismatch}; left out"  # drifted source

    def as_dict(self):
        return {"verdict": self.verdict, "distribution": self.distribution, "version": self.version,
                "rule": self.rule, "bound": self.bound, "seen": dict(self.seen), "mismatch": self.mismatch or None,
                "reason": self.reason}


def evaluate(patch: Patch, version: str | None = None, locate: Callable[[str], str | None] = module_file,
             others: Mapping[str, str] | None = None) -> Verdict:
    """A Verdict from the environment alone: selection and in-process state not considered.

    `version` and `locate` (module name -> source path) default to the installed ones; tests pass those of
    downloaded releases, and `others` {distribution: version} for the distributions in `patch.requires`."""
    version = installed_version(patch.distribution) if version is None else version
    if version is None:
        found = None
        for module in (patch.modules[0], patch.modules[0].partition(".")[0]):  # the target, or its package
            try:
                found = found or locate(module)
            except Exception:
                pass
        if found:  # its files are there, its metadata is not: say what is there, do not guess a release
            return Verdict(patch, BROKEN, None, "files", seen={"files": found})
        return Verdict(patch, NOT_INSTALLED, None, "absent")
    from dspatch.versions import SpecifierSet
    from dspatch.versions import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return Verdict(patch, DRIFTED, version, "version")
    # A dev, pre, post or local build (deepspeed built from git reports the *next* release plus +hash)
    # cannot be judged by its number: its source decides (a known affected release's, or upstream's fix).
    plain = not (parsed.is_prerelease or parsed.is_postrelease or parsed.local)
    release = Version(parsed.base_version)
    fixed = bool(patch.fixed_in) and release >= Version(patch.fixed_in)
    if plain and fixed:
        return Verdict(patch, FIXED_UPSTREAM, version, "release", patch.fixed_in)
    if plain and not SpecifierSet(patch.affected).contains(parsed):
        return Verdict(patch, NOT_AFFECTED, version, "range", patch.affected)
    needed = {}
    for other, wanted in patch.requires.items():  # the bug needs these too (torch >= 2.6, say)
        seen = others[other] if others and other in others else installed_version(other)
        try:
            has = seen is not None and SpecifierSet(wanted).contains(Version(seen).base_version)
        except InvalidVersion:
            has = True  # cannot tell: the source check below still decides
        if not has:
            return Verdict(patch, NOT_AFFECTED, version, "requires", f"{other}{wanted}", {other: seen})
        needed[other] = seen
    if patch.supported and not SpecifierSet(patch.supported).contains(release):
        return Verdict(patch, UNSUPPORTED, version, "supported", patch.supported)
    mismatch = _source_mismatch(patch, locate, version)
    if mismatch is None:
        return Verdict(patch, APPLIES, version, "source", patch.affected, needed, plain=plain)
    if not plain and _has_fix(patch, locate):
        return Verdict(patch, FIXED_UPSTREAM, version, "build fix", ":".join(patch.fixed_marker or ()))
    if not plain and fixed and not patch.fixed_marker:  # nothing in the source tells: its number decides
        return Verdict(patch, FIXED_UPSTREAM, version, "build number", patch.fixed_in)
    if not plain and not fixed and not SpecifierSet(patch.affected).contains(release):
        return Verdict(patch, NOT_AFFECTED, version, "range", patch.affected)
    return Verdict(patch, DRIFTED, version, "source", mismatch=mismatch)


def _has_fix(patch, locate):
    if not patch.fixed_marker:
        return False
    module, qualname = patch.fixed_marker
    path = locate(module)
    try:
        return path is not None and source_segment(path, qualname) is not None
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
