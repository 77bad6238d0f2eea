"""Known bugs of these packages that dspatch does not patch (yet): declared as data, with their ranges, the release
that fixes them and what to do meanwhile, so that `dspatch check` (this environment) and `dspatch audit` (a lock or
requirements file) name them where the versions have them. Facts: upstream's PRs and issues, each read against the
released sources (UPSTREAM.md section 8 in the project's notes); the ranges are those of upstream's code, proven on
CPU where the note says so.

When a patch for one of them lands, its entry goes (tests/test_audit.py checks that no id is both).
"""


class Known:
    """A known bug no patch fixes: `distribution` releases in `affected` (a PEP 440 specifier) have it, when the
    other packages are in `requires` ({distribution: specifier}); `fixed_in` is the first release without it (None:
    open upstream). `effect` says in a few words what it does to a run; `advice` what to do until upgrading."""

    def __init__(self, id, distribution, affected, fixed_in, effect, advice, links, requires=None, note=""):
        self.id, self.distribution, self.affected, self.fixed_in = id, distribution, affected, fixed_in
        self.effect, self.advice, self.links, self.requires = effect, advice, tuple(links), dict(requires or {})
        self.note = note  # how it was seen here, where it was

    def has(self, version, others):
        """Whether release `version` has it, by the numbers, with the other packages at `others` {distribution:
        version, or None where absent: then the bug cannot happen}."""
        from dspatch.versions import InvalidVersion, SpecifierSet, Version

        try:
            return in_range(self, version) and all(
                others.get(other) is not None and SpecifierSet(wanted).contains(Version(others[other]).base_version)
                for other, wanted in self.requires.items())
        except InvalidVersion:  # a version that is no release: cannot tell
            return False

    def __repr__(self):
        return f"Known({self.id})"


def in_range(item, version):
    """Whether release `version` (its base release) is in a bug's range: in `affected`, before `fixed_in`. For a
    Known and a Patch alike (dspatch.audit); InvalidVersion where `version` is no version."""
    from dspatch.versions import SpecifierSet, Version

    release = Version(Version(version).base_version)
    return not (item.fixed_in and release >= Version(item.fixed_in)) and SpecifierSet(item.affected).contains(release)


DS = "https://github.com/deepspeedai/DeepSpeed/pull/"

KNOWN = (
)


def present(installed):
    """The known bugs of the releases in `installed` {distribution: version, or None where absent}."""
    return [k for k in KNOWN if installed.get(k.distribution) and k.has(installed[k.distribution], installed)]
