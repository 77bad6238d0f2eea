"""dspatch: version-pinned fixes for known DeepSpeed / accelerate / transformers / trl bugs.

`DSPATCH=1` in the environment activates it in every process (see dspatch.pth); from code use
`dspatch.apply()` and `dspatch.revert()`. `dspatch check` (or `python -m dspatch.apply --check`) says what applies
and why.
"""
import os as _os

TYPE_CHECKING = False  # nothing more is imported at start-up (typing: 20 ms); mypy reads the quoted names
if TYPE_CHECKING:
    from collections.abc import Iterable

__version__ = "0.1.0"


_here = _os.path.dirname(_os.path.abspath(__file__))


def data_dir(name: str) -> str:
    """Directory of shipped data (`upstream_prs`), in a wheel or a source checkout."""
    inside = _os.path.join(_here, name)
    return inside if _os.path.isdir(inside) else _os.path.join(_os.path.dirname(_here), name)


def apply(ids: "Iterable[str] | str | None" = None, strict: "bool | None" = None) -> "dict[str, tuple[str, str]]":
    """Activate dspatch in this process: patch targets already imported now, the others when imported.

    `ids`: None for the selection in DSPATCH (every patch when DSPATCH is unset), or an iterable of patch ids
    or prefixes. Returns {patch id: (verdict, reason)}. Applying twice changes nothing."""
    from dspatch import _runtime, registry

    if ids is None and not registry.active():
        ids = ["all"]

    return _runtime.activate(ids, strict)


_apply = apply  # for dspatch's own callers: importing the module dspatch.apply rebinds `dspatch.apply` to it


def revert(ids: "Iterable[str] | None" = None, force: bool = False) -> "list[str]":
    """Undo applied patches (all, or these ids) and stop patching later imports. Returns the ids reverted.

    Refused (RuntimeError) while objects built under a patch may still depend on it, e.g. a ZeRO-3 engine
    (DeepSpeed keeps every engine reachable); `force=True` when those will not be used again."""
    from dspatch import _runtime

    return _runtime.revert(ids, force)


def check(ids: "Iterable[str] | str | None" = None) -> "list[dict]":
    """Verdict rows for every patch, as `dspatch check --json` prints them. A malformed DSPATCH or DSPATCH_DISABLE
    does not raise: every row says it is left out, and why (the runtime applies nothing while the value stands).
    Unknown `ids` given here raise dspatch.registry.SelectionError."""
    from dspatch import registry, status

    if ids is not None:
        registry.selection(ids, source="dspatch.check()")
    return [row.as_dict() for row in status.check_all(ids, source="dspatch.check()", refused=True)]
