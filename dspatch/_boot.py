"""Start-up hook, run from dspatch.pth only when DSPATCH is set.

It must stay cheap: standard library only, no file reads. It puts a finder at the front of sys.meta_path
that notices when a module of a watched package finishes executing; only then is the patch machinery
(dspatch._runtime, wrapt, packaging) imported. Packages imported before this hook are handled by the
runtime at activation.
"""
import sys

WATCHED = ("deepspeed", "accelerate", "transformers", "trl")


class PostImportFinder:
    """Finds nothing itself: asks the other finders, then chains a notification after exec_module."""

    def __init__(self, on_loaded):
        self.on_loaded = on_loaded
        self._resolving = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in WATCHED or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None) if finder is not self else None
                if find is not None:
                    spec = find(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._resolving.discard(fullname)
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


def _notify(name):
    from dspatch import _runtime

    _runtime.module_loaded(name)


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
