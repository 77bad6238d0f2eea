"""Loads the declared patches and resolves a selection (DSPATCH, DSPATCH_DISABLE) against them."""
from __future__ import annotations

import importlib
import os

from dspatch import patches as _patches_pkg
from dspatch._hook import distribution_folders, flag  # the one reading of on and off (dspatch.pth repeats the words)

TYPE_CHECKING = False  # typing is not imported for this (mypy reads the names below)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from dspatch.spec import Patch

ON_WORDS = {"1", "all", "true", "yes", "on"}

_cache = None


def all_patches() -> dict[str, Patch]:
    """{id: Patch} in registry order."""
    global _cache
    if _cache is None:
        found = {}
        for package, name in patch_folders():
            module = f"{_patches_pkg.__name__}.{package}.{name}"
            patch = _declared(importlib.import_module(module), package, name)
            patch.reproducers = f"{module}.reproducers"
            found[patch.id] = patch
        _cache = found
    return _cache


def patch_folders() -> list[tuple[str, str]]:
    """(package, name) of every folder dspatch/patches/<package>/<name>/ with an __init__.py, by package and name:
    the registry's order (the order patches apply in, and their rows). A name starting with "_" is a helper."""
    root = os.path.dirname(_patches_pkg.__file__)
    return [(package, name) for package in distribution_folders(root)
            for name in sorted(os.listdir(os.path.join(root, package)))
            if not name.startswith("_") and os.path.isfile(os.path.join(root, package, name, "__init__.py"))]


def _declared(module, package: str, name: str) -> Patch:
    """A patch folder must declare one Patch whose id is its path (`deepspeed/zero3_module_id` for
    deepspeed/zero3-module-id) and its reproducers beside it: a misnamed or half-written folder stops the registry
    with the reason, rather than loading under an id nobody can find."""
    from dspatch.spec import Patch  # noqa: F811 (the run-time name of the annotation's)

    where, patch = module.__name__, getattr(module, "PATCH", None)
    if not isinstance(patch, Patch):
        raise RuntimeError(f"dspatch: {where} declares no PATCH (a dspatch.spec.Patch)")
    if patch.id != f"{package}/{name.replace('_', '-')}" or patch.distribution != package:
        raise RuntimeError(f"dspatch: {where} declares {patch.id!r} for {patch.distribution!r}; its folder makes it "
                           f"'{package}/{name.replace('_', '-')}' for {package!r}")
    if not os.path.isfile(os.path.join(os.path.dirname(module.__file__), "reproducers.py")):
        raise RuntimeError(f"dspatch: {where} has no reproducers.py beside it")
    if not patch.all_targets:  # every verdict starts from a target: none would fail later, with a worse message
        raise RuntimeError(f"dspatch: {where} declares no targets")
    return patch


class SelectionError(ValueError):
    pass


def short(value, limit=60):
    """A user's value as echoed in a message: repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} characters)"


HOW = "`dspatch check` lists the ids"


def closest(token, known=None):
    """The known id a mistyped one most likely meant, or None."""
    known = list(all_patches()) if known is None else list(known)
    starting = [pid for pid in known if pid.startswith(token)]
    if starting:  # the one that adds the least to what was typed
        return min(starting, key=lambda pid: (len(pid), pid))
    import difflib  # only on this error's path

    found = difflib.get_close_matches(token, known, n=1, cutoff=0.6)
    if not found:  # a name typed without its package: deepspeed/zero3-module-id for zero3-moduleid
        names = {pid.split("/", 1)[-1]: pid for pid in known}
        found = [names[n] for n in difflib.get_close_matches(token.split("/")[-1], list(names), n=1, cutoff=0.6)]
    return found[0] if found else None


def _resolve_tokens(tokens, source, empty_ok=False):
    """The ids `tokens` select. A SelectionError's message is one short line: the value, the unknown id, the id it
    most likely meant, where the ids are listed (never the list itself: it grows with every patch)."""
    known = all_patches()
    if not tokens and not empty_ok:
        raise SelectionError(f"{source} names no patch ({HOW})")
    chosen = []
    for token in tokens:
        if token.lower() in ON_WORDS:
            chosen.extend(known)
            continue
        # an id, or a prefix of ids ending at a "/" (e.g. "deepspeed" selects every deepspeed/... patch)
        hits = [pid for pid in known if pid == token or pid.startswith(token.rstrip("/") + "/")]
        if not hits:
            what = "is an unknown patch id" if len(tokens) == 1 else f"names an unknown patch id {short(token, 60)}"
            guess = closest(token, known)
            hint = f" (did you mean {guess}?)" if guess else f" ({HOW})"
            raise SelectionError(f"{source} {what}{hint}")
        chosen.extend(hits)
    return chosen


def split(value):
    return [t.strip() for t in value.replace(";", ",").split(",") if t.strip()]


def selection(ids: Iterable[str] | str | None = None, environ: Mapping[str, str] | None = None,
              source: str = "dspatch.apply()") -> tuple[list[str], dict[str, str]]:
    """The ids selected by `ids` (code) or by DSPATCH, less DSPATCH_DISABLE. Raises SelectionError.

    Returns (selected ids in registry order, reason text for each patch left out)."""
    env = os.environ if environ is None else environ
    known = all_patches()
    if ids is None:
        raw = env.get("DSPATCH", "").strip()
        if not active(env):
            wanted = []
        elif raw.lower() in ON_WORDS:
            wanted = list(known)
        else:
            wanted = _resolve_tokens(split(raw), f"DSPATCH={short(raw)}")
    else:
        tokens = split(ids) if isinstance(ids, str) else [t for t in ids]
        wanted = _resolve_tokens(tokens, source)
    raw_disable = env.get("DSPATCH_DISABLE", "")
    disabled = set(_resolve_tokens(split(raw_disable), f"DSPATCH_DISABLE={short(raw_disable)}", empty_ok=True))
    chosen = [pid for pid in known if pid in wanted and pid not in disabled]
    left_out = {}
    for pid in known:
        if pid in disabled:
            left_out[pid] = "disabled by DSPATCH_DISABLE"
        elif pid not in wanted:
            left_out[pid] = "not selected by DSPATCH" if ids is None else "not selected"
    return chosen, left_out


def named(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ids DSPATCH names one by one (not through 1 or a prefix): a user who names a patch wants to hear when it
    does not apply."""
    env = os.environ if environ is None else environ
    known = all_patches()
    return [token for token in split(env.get("DSPATCH", "")) if token in known]


def active(environ: Mapping[str, str] | None = None) -> bool:
    """Whether DSPATCH turns dspatch on at all (its ids: selection())."""
    return flag("DSPATCH", environ)
