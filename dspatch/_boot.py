"""Start-up hook, run from dspatch.pth only when DSPATCH is set.

It must stay cheap: standard library only, no file reads. It puts a finder at the front of sys.meta_path
that notices when a module of a watched package finishes executing; only then is the patch machinery
(dspatch._runtime, wrapt, packaging) imported. Packages imported before this hook are handled by the
runtime at activation.
"""
import os
import sys
import threading

WATCHED = ("deepspeed", "accelerate", "transformers", "trl")


class PostImportFinder:
    """Finds nothing itself: asks the other finders, then chains a notification after exec_module."""

    def __init__(self, on_loaded):
        self.on_loaded = on_loaded
        self._local = threading.local()  # names this thread is resolving through the other finders

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in WATCHED:
            return None
        resolving = self._local.__dict__.setdefault("names", set())
        if fullname in resolving:
            return None
        resolving.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None) if finder is not self else None
                if find is not None:
                    spec = find(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            resolving.discard(fullname)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        # Only per-module loader instances (source and bytecode files) are hooked; shared loaders are left alone.
        if exec_module is None or isinstance(loader, type) or not hasattr(loader, "__dict__"):
            return spec
        on_loaded = self.on_loaded

        def exec_module_then_notify(module):
            exec_module(module)
            on_loaded(module.__name__)

        loader.exec_module = exec_module_then_notify
        return spec


_failed = []


def _notify(name):
    # The user's import must survive any failure of dspatch itself; DSPATCH_STRICT=1 wants it to surface.
    try:
        from dspatch import _runtime

        _runtime.module_loaded(name)
    except Exception as e:
        if os.environ.get("DSPATCH_STRICT", "").strip().lower() not in ("", "0", "false", "no", "off"):
            raise
        if not _failed:
            _failed.append(e)
            print(f"dspatch: internal error after importing {name}: {type(e).__name__}: {e} "
                  f"(dspatch left this import alone; please report it)", file=sys.stderr)


def finder():
    for f in sys.meta_path:
        if isinstance(f, PostImportFinder):
            return f
    return None


def install():
    """Called by dspatch.pth. Never raises into `site`: a broken hook must not break the interpreter."""
    if finder() is None:
        sys.meta_path.insert(0, PostImportFinder(_notify))
    if any(name in sys.modules for name in WATCHED):
        # Something imported a target before us (another .pth): let the runtime catch up now.
        from dspatch import _runtime

        _runtime.activate(None, None)


def uninstall():
    f = finder()
    if f is not None:
        sys.meta_path.remove(f)
