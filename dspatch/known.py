"""Known bugs of these packages that dspatch does not patch (yet): declared as data, with their ranges, the release
that fixes them and what to do meanwhile, so that `dspatch check` (this environment) and `dspatch audit` (a lock or
requirements file) name them where the versions have them. Facts: upstream's PRs and issues, each read against the
released sources; the ranges are those of upstream's code, proven on CPU where the note says so.

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


KNOWN = (
    Known("deepspeed/branch-around-engine-ga", "deepspeed", ">=0.18.3,<0.19.6", "0.19.6",
          effect=("with gradient accumulation, a loss with a branch around engine.forward (engine(x) + "
                  "engine.module(y)) trains that branch GA times too fast, silently"),
          advice=("call the engine for every use of the model, or upgrade to 0.19.6; deepspeed/output-hooks-gas-per-"
                  "tensor does not cover this shape"),
          links=("https://github.com/deepspeedai/DeepSpeed/issues/8224",
                 "https://github.com/deepspeedai/DeepSpeed/pull/8245"),
          note=("measured on 0.18.3 and 0.19.2 at GA 2 (every ZeRO stage, fp32 and bf16, one rank or two): the "
                "branch around the engine counts exactly GA times; right on 0.19.8")),
    Known("deepspeed/zero-to-fp32-int-buffers", "deepspeed", "<0.19.8", "0.19.8",
          effect=("zero_to_fp32 (get_fp32_state_dict_from_zero_checkpoint) writes integer and bool buffers as "
                  "float32: an int64 above 2^24 (offsets, indices) comes back another number, silently"),
          advice=("load the consolidated state dict into the model (load_state_dict copies into its own dtypes) "
                  "and re-save it, check integer buffers above 2^24, or upgrade to 0.19.8"),
          links=("https://github.com/deepspeedai/DeepSpeed/pull/8515",),
          note=("read in the released sources: `v.float()` for every buffer from 0.9.0 to 0.19.7, and 0.19.7's "
                "dtype-selectable export casts them too; 0.19.8 casts floating buffers only")),
)


def present(installed):
    """The known bugs of the releases in `installed` {distribution: version, or None where absent}."""
    return [k for k in KNOWN if installed.get(k.distribution) and k.has(installed[k.distribution], installed)]
