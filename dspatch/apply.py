"""`python -m dspatch.apply --check` and `python -m dspatch.apply script.py`: the first releases' command line, kept
working (dspatch.legacy; the `dspatch` command is dspatch.cli). Its flags: `--check [--json] [-v] [--strict] [--verify]`,
`[--only IDS] script.py [args...]`.

Imported rather than run, this module would take the place of the function `dspatch.apply` on the package (Python
binds a submodule there once imported): it is made callable as that function, so `dspatch.apply(...)` keeps working.
"""
import sys
import types


class _CallsTheFunction(types.ModuleType):
    def __call__(self, ids=None, strict=None):
        import dspatch

        return dspatch._apply(ids, strict)


if __name__ == "__main__":
    from dspatch import legacy, term

    term.exit_with(legacy.main)
else:
    sys.modules[__name__].__class__ = _CallsTheFunction
