"""Start-up hook, run from dspatch.pth only when DSPATCH is set (to anything but an off word).

It must stay cheap: standard library only, no file reads. It puts a finder at the front of sys.meta_path
that notices when a module of a watched package finishes executing; only then is the patch machinery
(dspatch._runtime, wrapt, packaging) imported. Packages imported before this hook are handled by the
runtime at activation.
"""
import os
import sys

WATCHED = ("deepspeed", "accelerate", "transformers", "trl")
OFF_WORDS = ("", "0", "false", "no", "off", "none")  # dspatch.pth and dspatch.registry use the same words


def strict():
    return os.environ.get("DSPATCH_STRICT", "").strip().lower() not in OFF_WORDS


class NotifyingLoader:
    """Stands in for one spec's loader: runs the real loader, then reports the module as loaded.

    The real loader is never modified (zipimporter and other loaders are shared between modules), and the
    module gets the real loader back as __loader__ / __spec__.loader before it executes."""

    def __init__(self, loader, on_loaded):
        self.loader = loader
        self.on_loaded = on_loaded

    def __getattr__(self, name):
        # only for attributes the real loader has (get_source, get_resource_reader, ...); never for our own
        # two or for dunders, which copy and pickle look up on an instance that has no `loader` yet
        if name in ("loader", "on_loaded") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.on_loaded(module.__name__)


class PostImportFinder:
    """Finds nothing itself: asks the other finders, then chains a notification after exec_module."""

    def __init__(self, on_loaded, watched=WATCHED):
        self.on_loaded = on_loaded
        self.watched = tuple(watched)
        # Names being resolved through the other finders. A plain set is enough: importlib holds its global
        # import lock around every meta-path find_spec (and `threading` would cost ~5 ms at start-up).
        self._resolving = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.watched:
            return None
        resolving = self._resolving
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
        if loader is not None and hasattr(loader, "exec_module") and not isinstance(loader, NotifyingLoader):
            spec.loader = NotifyingLoader(loader, self.on_loaded)
        return spec


_failed = []


def _notify(name):
    # The user's import must survive any failure of dspatch itself; strict mode (DSPATCH_STRICT=1 or
    # dspatch.apply(strict=True)) wants it to surface.
    runtime = None
    try:
        from dspatch import _runtime as runtime

        runtime.module_loaded(name)
    except Exception as e:
        if strict() or getattr(runtime, "_strict", False):
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
    """Called by dspatch.pth. Never raises into `site` (which would print and carry on regardless): a
    failure is reported, and with DSPATCH_STRICT=1 it ends the process, as an error at import would."""
    if finder() is None:
        sys.meta_path.insert(0, PostImportFinder(_notify))
    if any(name in sys.modules for name in WATCHED):
        # Something imported a target before us (another .pth): let the runtime catch up now.
        try:
            from dspatch import _runtime

            _runtime.activate(None, None)
        except Exception as e:
            print(f"dspatch: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if strict():  # `site` would only print and go on: end the process as a failed import would
                os._exit(2)


def uninstall():
    f = finder()
    if f is not None:
        sys.meta_path.remove(f)
