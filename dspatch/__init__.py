"""dspatch: version-pinned fixes for known DeepSpeed / accelerate / transformers / trl bugs.

`DSPATCH=1` in the environment activates it in every process (see dspatch.pth); from code use
`dspatch.apply()` and `dspatch.revert()`. `python -m dspatch.apply --check` says what applies and why.
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _mount_source_tree():
    # In a wheel, `patches/` and `upstream_prs/` are installed inside this package. In a source checkout
    # (editable install, tests) they sit beside it: expose them under the same names.
    here = _os.path.dirname(_os.path.abspath(__file__))
    inside = _os.path.join(here, "patches")
    beside = _os.path.join(_os.path.dirname(here), "patches")
    if _os.path.isdir(inside) or not _os.path.isfile(_os.path.join(beside, "__init__.py")):
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        __name__ + ".patches", _os.path.join(beside, "__init__.py"), submodule_search_locations=[beside])
    module = importlib.util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_mount_source_tree()


def data_dir(name):
    """Directory of shipped data (`upstream_prs`), in a wheel or a source checkout."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    inside = _os.path.join(here, name)
    return inside if _os.path.isdir(inside) else _os.path.join(_os.path.dirname(here), name)


def apply(ids=None, strict=None):
    """Activate dspatch in this process: patch targets already imported now, the others when imported.

    `ids`: None for the selection in DSPATCH (all when unset), or an iterable of patch ids / prefixes.
    Returns {patch id: verdict} for the selected patches. Applying twice changes nothing."""
    from dspatch import _runtime

    return _runtime.activate(ids, strict)


def revert(ids=None):
    """Undo applied patches (all, or these ids) and stop patching later imports. Returns the ids reverted."""
    from dspatch import _runtime

    return _runtime.revert(ids)


def check(ids=None):
    """Verdict rows for every patch, as `python -m dspatch.apply --check --json` prints them."""
    from dspatch import gating

    return [row.as_dict() for row in gating.check_all(ids)]
