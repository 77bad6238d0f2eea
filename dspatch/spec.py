"""What a patch declares. Patch modules import only this at module level, so reading the registry is cheap.

The contract is typed: mypy (the lint session) checks every patch's declaration against these signatures."""
from typing import Any, Callable, Iterable, Mapping, Optional, Union

# {fingerprint of a released source: the releases that shipped it ("0.14.0-0.15.3", "0.16.3")}
Fingerprints = Mapping[str, str]
# a line pattern of a Signature: a regular expression, or a function of a line for what a pattern cannot say
LinePattern = Union[str, Callable[[str], bool]]


class Target:
    """A function the patch replaces or wraps, and the fingerprints of its source as released.

    `qualname` is "Class.method" or "function" inside `module`. `fingerprints` maps the fingerprint of the
    released source (see dspatch.upstream.fingerprint) to the releases that shipped it.

    `releases`: for code that moved between modules across releases, the PEP 440 specifier of the releases
    that have it at this module (None: every release). A patch whose targets declare it gets, in each
    release, the targets of that release only (see Patch.targets_for)."""

    def __init__(self, module: str, qualname: str, fingerprints: Fingerprints, releases: Optional[str] = None) -> None:
        self.module = module
        self.qualname = qualname
        self.fingerprints = dict(fingerprints)
        self.releases = releases

    def __repr__(self):
        return f"{self.module}:{self.qualname}"


class Signature:
    """How a log shows one bug, for `python -m dspatch.explain` (dspatch/explain/ reads these).

    - `message`: regular expression searched in the message of the error (or the warning) the bug produces on stock
      upstream. A message the log wraps over lines, or puts under an empty `SomeError:` line, is read joined.
    - `error`: the exception's class name (`AttributeError`; alternatives as `RuntimeError|AssertionError`). The
      text before the message must then be that name with its colon (qualified or not: `_pickle.UnpicklingError:`),
      and not a longer name that ends with it (`ModuleAttributeError:`), or nothing at all (a message pasted
      alone). None: the message alone decides.
    - `needs`: regular expressions (or functions of a line, for what a pattern cannot say) that must each match a
      line of the message's own traceback (its frames, the lines of the message that follow), so that a message
      other failures also give names this bug only with them;
      `context`: ones that must each match somewhere in the log (ranks interleave: the frames of one rank's
      traceback may follow another rank's message).
    - `hints`: regular expressions of which one, anywhere in the log, tells this cause from another with the same
      message (a frame of the Trainer, say); `unless`: ones that, anywhere in the log, tell another cause (the
      candidate is dropped).
    - `generic`: the message is one another patch's more specific message also matches (an attribute missing
      on the engine); on the same line the specific one is named and this one is not.
    - `tell`: for a reader whose log cannot tell this cause from another with the same message: what to look at.
    - `also`: a failure that no patch fixes and that writes these very lines (versions aside): the log then names
      this bug only where one of its `hints` is there; otherwise it is offered, with `also` said beside it.
    """

    def __init__(self, message: str, error: Optional[str] = None, needs: Iterable[LinePattern] = (),
                 context: Iterable[LinePattern] = (), hints: Iterable[LinePattern] = (),
                 unless: Iterable[LinePattern] = (), generic: bool = False, tell: str = "", also: str = "") -> None:
        self.message = message
        self.error = error
        self.needs = tuple(needs)
        self.context = tuple(context)
        self.hints = tuple(hints)
        self.unless = tuple(unless)
        self.generic = generic
        self.tell = tell
        self.also = also

    def __repr__(self):
        return f"Signature({self.error + ': ' if self.error else ''}{self.message!r})"


def stock_fails_on(distribution, releases):
    """A Proof.stock_fails_on value as {distribution: (specifier, ...)} (any of a distribution's specifiers will do)."""
    if isinstance(releases, str):
        releases = {distribution: releases}
    return {name: (specs,) if isinstance(specs, str) else tuple(specs) for name, specs in releases.items()}


def _installed_within(releases):
    """Whether every distribution of `releases` ({distribution: (specifier, ...)}) is installed within one of its
    specifiers."""
    from dspatch.gating import installed_version
    from dspatch.versions import InvalidVersion, within_any

    for distribution, specs in releases.items():
        version = installed_version(distribution)
        try:
            if version is None or not within_any(version, specs):
                return False
        except InvalidVersion:
            return False
    return True


def band_of(path: str) -> str:
    """The specifier of the releases a diff applies to, from its name: "...-0.14.3-0.17.0.patch" is ">=0.14.3,<=0.17.0",
    "...-0.15.4.patch" is "==0.15.4"."""
    import re

    found = re.search(r"-(\d+(?:\.\d+)+)(?:-(\d+(?:\.\d+)+))?\.patch$", path)
    if not found:
        raise TypeError(f"{path}: a diff's name ends with the band of releases it applies to (-FIRST-LAST.patch)")
    first, last = found.groups()
    if last:
        from dspatch.versions import Version

        if Version(first) > Version(last):  # "...-torch-2.6-0.18.4.patch": a description ending in a version
            raise TypeError(f"{path}: its band {first}-{last} runs backwards (the name before the band must not end "
                            "in a version)")
        return f">={first},<={last}"
    return f"=={first}"


class Patch:
    """One upstream bug, the versions it affects, the code it touches and how to fix it in-process.

    - `affected`: PEP 440 specifier of the releases with the bug; `fixed_in`: first release fixed upstream;
      `supported`: the releases the patch was written and tested for (older affected ones are left out).
    - `apply(ctx)`: installs the fix through ctx (dspatch._runtime.Transaction), which records every change
      so a failure part-way leaves nothing behind and `revert` can undo it.
    - `targets`: the fingerprint table, {(module, qualname): {fingerprint: releases}}, or Target objects (for code
      that moved between modules across releases: Target(..., releases=...)).
    - reproducers: real-upstream scenarios, in `reproducers.py` beside the patch's own module (its folder), which
      declares them and what they prove as `PROOF`, a `Proof` (see there); loaded only by `dspatch verify` and the
      tests, through the properties that read it; importable without torch.
    - `diffs`: the upstream PR diffs, paths under upstream_prs/, each named for the band of releases it applies to,
      the band written once, in the name: `...-0.14.3-0.17.0.patch` (releases 0.14.3 to 0.17.0), `...-0.15.4.patch`
      (that release alone). `Patch.diffs` maps each band's specifier to its path.
    - `fixed_marker`: optional (module, qualname) of a definition that exists only once upstream's fix is in;
      how a build that is not a plain release (git, dev, local) is recognised as fixed.
    - `requires`: {other distribution: PEP 440 specifier} the bug also needs (torch >= 2.6 for a torch.load
      default, say); outside it the verdict is "not affected" and says which version was seen.
    - `renamed`: for a rename-style fix, the attribute renamed, and {"path:function": why} for functions of
      the package that read or write an attribute of that name which is not the renamed one (tests check,
      over every affected release's source, that no other function touches it).
    - `signatures`: how a log shows this bug on stock upstream (Signature objects; see there), for
      `python -m dspatch.explain LOG`. Match the bug's own words and the frames that tell it from other failures
      with the same words: a wrong name sends a user to a fix for a bug they do not have.
    - `cause`: what goes wrong on stock upstream, in one sentence (the first line of `explain` and `check -v`; the
      `summary` says what the patch does about it).
    - `canary`: for a silent bug, the shapes of divergence `dspatch canary` tells (the keys of
      dspatch.canary.verdict.SHAPES, one table): a divergence of one of them names the patch as a candidate.
    - `symptom`: what a user sees on stock upstream, in a few words (the error's own text where there is one; for a
      silent bug, the wrong result): the README's short table shows it beside the patch id.
    - `note`: what a user should know while it is applied (shown by --check), e.g. that debuggers show the
      installed file while the code that runs was rebuilt from it.
    - `in_use()`: optional; a reason why applying now (after its targets were imported and used) or reverting
      would break live objects, or None. Checked before a late apply and before a revert.
    """

    def __init__(self, id: str, summary: str, distribution: str, affected: str, fixed_in: Optional[str],
                 targets: Union[Mapping[tuple[str, str], Fingerprints], Iterable[Target]],
                 apply: Optional[Callable[[Any], None]], supported: str = "", links: Iterable[str] = (),
                 diffs: Iterable[str] = (), in_use: Optional[Callable[[], Optional[str]]] = None,
                 fixed_marker: Optional[tuple[str, str]] = None, note: str = "",
                 requires: Optional[Mapping[str, str]] = None,
                 renamed: Optional[tuple[str, Mapping[str, str]]] = None, signatures: Iterable[Signature] = (),
                 reproducers: Optional[str] = None, symptom: str = "", cause: str = "",
                 canary: Iterable[str] = ()) -> None:
        self.id = id
        self.summary = summary
        self.distribution = distribution
        self.affected = affected
        self.fixed_in = fixed_in
        self.supported = supported
        if isinstance(targets, dict):
            targets = [Target(module, qualname, prints) for (module, qualname), prints in targets.items()]
        self.all_targets = tuple(targets)
        self._installed_targets = None
        self._modules = None
        self.apply = apply
        self.links = tuple(links)
        self.diffs = {band_of(path): path for path in diffs}
        self.reproducers = reproducers  # module name; the registry sets it from the patch module's name
        self.left_out = None  # a target's qualname while a proof applies the patch without it
        self.in_use = in_use
        self.fixed_marker = fixed_marker
        self.note = note
        self.requires = dict(requires or {})
        self.renamed = renamed
        self.signatures = tuple(signatures)
        if not all(isinstance(s, Signature) for s in self.signatures):
            raise TypeError(f"{id}: signatures must be Signature objects (dspatch.spec.Signature)")
        self.symptom = symptom
        self.cause = cause
        self.canary = tuple(canary)

    def _reproducers(self):
        import importlib

        if not self.reproducers:
            return None
        return importlib.import_module(self.reproducers)

    @property
    def scenarios(self):
        """{name: reproducer}, from the reproducers module (imported on first use)."""
        return dict(self._declared("scenarios", {}))

    @property
    def declared_on_stock(self):
        """{scenario: (fragment, releases)}: every stock failure declared, with the specifier of the releases that
        show it (None: every release the patch applies to)."""
        only = self._declared("stock_fails_on", {})
        return {name: (fragment, only.get(name)) for name, fragment in self._declared("expected_on_stock", {}).items()}

    @property
    def expected_on_stock(self):
        """{scenario: fragment} that stock of the installed release must show."""
        expected = {}
        for name, (fragment, releases) in self.declared_on_stock.items():
            if releases is None or _installed_within(stock_fails_on(self.distribution, releases)):
                expected[name] = fragment
        return expected

    @property
    def band_check(self):
        return self._declared("band_check", None) or next(iter(self.expected_on_stock or self.declared_on_stock), None)

    def _declared(self, name, default):
        """What the reproducers module's PROOF declares as `name`, or `default` (no module)."""
        module = self._reproducers()
        if module is None:
            return default
        proof = getattr(module, "PROOF", None)
        if not isinstance(proof, Proof):
            raise TypeError(f"{self.id}: {module.__name__} declares no PROOF (a dspatch.spec.Proof)")
        found = getattr(proof, name)
        return default if found is None else found

    @property
    def releases_checked(self):
        """(first, last) release of the distribution that tests/test_releases.py checks; None: not declared."""
        found = self._declared("releases_checked", None)
        return tuple(found) if found else None

    @property
    def others_with_and_without(self):
        """({other distribution: version with the bug's need}, {...: version without}); None: not declared."""
        found = self._declared("others_with_and_without", None)
        return (dict(found[0]), dict(found[1])) if found else None

    @property
    def silent(self):
        """Why `python -m dspatch.explain` cannot name the bug (it writes nothing to a log); "": it can."""
        return self._declared("silent", "")

    @property
    def loud_on(self):
        """For a bug `silent` on some releases only: those (a PEP 440 specifier) where it writes an error instead,
        which its `signatures` name (the reproducers' `Proof.loud_on`); "": none."""
        return self._declared("loud_on", "")

    @property
    def necessity_proven_by(self):
        """The test ("file.py::test") that proves each target necessary in place of --leave-out-each; "": none."""
        return self._declared("necessity_proven_by", "")

    @property
    def proven_in(self):
        """The sessions outside the matrix that prove this patch (Proof.proven_in)."""
        return self._declared("proven_in", ())

    @property
    def own_tests_in(self):
        """The sessions outside the matrix that run this patch's own tests only (Proof.own_tests_in)."""
        return self._declared("own_tests_in", ())

    def targets_for(self, version):
        """The targets release `version` of the distribution has: those whose `releases` contain it, and those
        without `releases`. Every target when `version` is None."""
        if version is None or all(t.releases is None for t in self.all_targets):
            return self.all_targets
        from dspatch.versions import SpecifierSet
        from dspatch.versions import InvalidVersion, Version

        try:
            parsed = Version(version)
        except InvalidVersion:  # not a release: only the targets every release has
            return tuple(t for t in self.all_targets if t.releases is None)
        return tuple(t for t in self.all_targets
                     if t.releases is None or SpecifierSet(t.releases).contains(parsed, prereleases=True))

    @property
    def targets(self):
        """The targets of the installed release (targets_for its version, read once per process); every target
        when the distribution is not installed or its release has none (the gate then says why)."""
        if self._installed_targets is None:
            found = self.all_targets
            if any(t.releases is not None for t in found):
                from dspatch.gating import installed_version

                found = self.targets_for(installed_version(self.distribution)) or found
            self._installed_targets = found
        return self._installed_targets

    @property
    def modules(self):
        if self._modules is None:  # asked on every module load of a watched package: computed once
            self._modules = tuple(dict.fromkeys(t.module for t in self.targets))
        return self._modules

    def diff_for(self, version):
        """The upstream diff (path under upstream_prs/) for this release, or None."""
        from dspatch.versions import SpecifierSet

        for band, path in self.diffs.items():
            if SpecifierSet(band).contains(version, prereleases=True):
                return path
        return None

    def __repr__(self):
        return f"<Patch {self.id}>"


# a Proof.stock_fails_on entry: a specifier of the patch's distribution, or {distribution: specifier or specifiers (any)}
StockFailsOn = Union[str, Mapping[str, Union[str, tuple[str, ...]]]]


class Proof:
    """What a patch's reproducers prove, declared once as `PROOF = Proof(...)` at the end of its reproducers.py (mypy
    checks the declaration against this signature; the registry's tests check what a signature cannot).

    - `scenarios`: {name: callable}: each returns None when behaviour is correct and raises `BugSeen` when the bug
      shows (see dspatch.verify).
    - `expected_on_stock`: {scenario: fragment of its BugSeen message} that stock upstream must show, the proof that
      the patch is needed; only that failure counts as the bug.
    - `releases_checked`: (first, last) release of the distribution that tests/test_releases.py checks.
    - `stock_fails_on`: {scenario: PEP 440 specifier}: the releases whose stock shows that failure, where stock
      passes the scenario on the others; or {scenario: {distribution: specifier, or a tuple of specifiers of which
      any will do}} where it takes other packages' releases too.
    - `band_check`: the cheapest reproducer, run on the released source of each diff band no test stack installs
      (default: the first of expected_on_stock).
    - `others_with_and_without`: for `requires`: ({other: a version with the bug's need}, {other: one without}), for
      the release suite.
    - `silent`: why `explain` cannot name a bug that writes nothing to a log; with `loud_on`, a specifier, the
      releases where it writes an error instead, which the patch's `signatures` name.
    - `necessity_proven_by`: "test_x.py::test", a test of the patch's own folder that proves each target necessary
      in place of the shared proof.
    - `proven_in`: the noxfile's sessions outside the matrix (`proving_session`: releases no stack installs) that run
      the patch's proofs and own tests; `own_tests_in`: those that run its own tests only. A session runs exactly
      the patches that name it.
    """

    def __init__(self, scenarios: Mapping[str, Callable[[], None]], expected_on_stock: Mapping[str, str],
                 releases_checked: tuple[str, str], stock_fails_on: Optional[Mapping[str, StockFailsOn]] = None,
                 band_check: Optional[str] = None,
                 others_with_and_without: Optional[tuple[Mapping[str, Optional[str]],
                                                         Mapping[str, Optional[str]]]] = None,
                 silent: str = "", loud_on: str = "", necessity_proven_by: str = "", proven_in: Iterable[str] = (),
                 own_tests_in: Iterable[str] = ()) -> None:
        self.scenarios = dict(scenarios)
        self.expected_on_stock = dict(expected_on_stock)
        self.releases_checked = tuple(releases_checked)
        self.stock_fails_on = dict(stock_fails_on or {})
        self.band_check = band_check
        self.others_with_and_without = others_with_and_without
        self.silent = silent
        self.loud_on = loud_on
        self.necessity_proven_by = necessity_proven_by
        self.proven_in = tuple(proven_in)
        self.own_tests_in = tuple(own_tests_in)
        unknown = set(self.expected_on_stock) - set(self.scenarios)
        if unknown or not self.expected_on_stock or (band_check and band_check not in self.scenarios):
            raise TypeError(f"Proof: expected_on_stock names no scenario of its own ({sorted(unknown)}), or is empty, "
                            f"or band_check {band_check!r} is not a scenario")


class BugSeen(AssertionError):
    """Raised by a scenario when the upstream bug shows."""
