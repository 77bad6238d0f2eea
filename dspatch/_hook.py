"""The import hook's machinery: standard library only, imports nothing from dspatch (the bottom of its
dependency graph: registry, gating and the runtime import from here; only the start-up entry, dspatch._boot, and
the runtime install it).

A finder at the front of sys.meta_path notices when a module of a watched package finishes executing and calls
back with its name.
"""
import os
import sys



def distribution_folders(root):
    """The packages dspatch/patches/ has folders for (each holds the patches of that package), sorted."""
    return sorted(name for name in os.listdir(root) if not name.startswith("_")
                  and os.path.isfile(os.path.join(root, name, "__init__.py")))


# The packages whose imports the hook watches: those the patches are for, read from the folders (a patch for a new
# package is watched by being there; no list to keep). A directory listing: nothing is imported.
WATCHED = tuple(distribution_folders(os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")))
OFF_WORDS = ("", "0", "false", "no", "off", "none")  # dspatch.pth repeats them: it runs before any import


def flag(name, environ=None, default=""):
    """Whether the variable `name` is on: set to anything but an off word. The one reading of DSPATCH (on at all;
    its ids: dspatch.registry.selection), DSPATCH_STRICT, DSPATCH_VERBOSE and DSPATCH_CACHE."""
    env = os.environ if environ is None else environ
    return env.get(name, default).strip().lower() not in OFF_WORDS


def strict(environ=None):
    """DSPATCH_STRICT=1: a patch that cannot apply, or a bad selection, is an error instead of a report."""
    return flag("DSPATCH_STRICT", environ)


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


def finder():
    for f in sys.meta_path:
        if isinstance(f, PostImportFinder):
            return f
    return None


def install(on_loaded):
    """Put the finder at the front of sys.meta_path (once)."""
    if finder() is None:
        sys.meta_path.insert(0, PostImportFinder(on_loaded))


def uninstall():
    f = finder()
    if f is not None:
        sys.meta_path.remove(f)


_failed: list = []


def report_failure(name, error, strict_now=False):
    """The user's import must survive any failure of dspatch itself; strict mode (DSPATCH_STRICT=1 or
    dspatch.apply(strict=True)) wants it to surface. Called from inside the `except` that caught `error`."""
    if strict() or strict_now:
        raise error
    if not _failed:
        _failed.append(error)
        print(f"dspatch: internal error after importing {name}: {type(error).__name__}: {error} "
              f"(dspatch left this import alone; please report it)", file=sys.stderr)
