"""What dspatch computes from an upstream source file, kept on disk as Python keeps `__pycache__`: so that every
rank of every job does not tokenize and recompile the same functions again.

An entry is found only by everything it was computed from: the bytes of the upstream file (a hash of its content,
never its size or mtime), the Python that computed it (`sys.implementation.cache_tag` and its full version), and
the source of dspatch's own code that computed it (the modules named by the caller: gating for fingerprints;
gating, rewrite and the patch's module for rebuilt code). So an entry can never be used for anything else; one
computed by another dspatch, another Python or from another file is simply not found.

Entries live in `$XDG_CACHE_HOME/dspatch/computed` (default `~/.cache/dspatch/computed`), one file each, written
to a temporary name and renamed, so ranks starting together on one node share them safely. A missing, unreadable,
corrupt or foreign entry, or a cache folder that cannot be written (read-only home, a container), means the value is
computed as if there were no cache: never a wrong value, never an error. `DSPATCH_CACHE=0` turns the cache off.
"""
import marshal
import os
import sys

try:  # BLAKE2b as the interpreter builds it in: hashlib would load OpenSSL first (2-3 ms, a tenth of --check)
    from _blake2 import blake2b as _blake2b
except ImportError:  # an interpreter without it
    from hashlib import blake2b as _blake2b

_FORMAT = b"dspatch-cache-2\n"
_sources: dict = {}  # module file -> hash of its bytes, once per process
_contents: dict = {}  # (path, stat fields incl. ctime) -> hash of the file's bytes, within this process


def digest(data=b""):
    """A 256-bit BLAKE2b hash object (what every key and content hash of the cache is)."""
    return _blake2b(data, digest_size=32)


def enabled():
    from dspatch._hook import flag

    return flag("DSPATCH_CACHE", default="1")


def folder():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dspatch", "computed")


def content_hash(path):
    """The hash of a file's bytes. Read again whenever its stat changed, ctime included: any write changes ctime,
    which no tool can set back (an edit that keeps size and mtime is still seen)."""
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
    found = _contents.get(key)
    if found is None:
        with open(path, "rb") as f:
            found = digest(f.read()).hexdigest()
        _contents[key] = found
    return found


def code_hash(*modules):
    """What the named modules of dspatch (module objects) compute with: a hash of their source files."""
    combined = digest()
    for module in modules:
        path = module.__file__
        if path not in _sources:
            with open(path, "rb") as f:
                _sources[path] = digest(f.read()).hexdigest()
        combined.update(_sources[path].encode())
    return combined.hexdigest()


def _key(kind, parts):
    text = "\0".join([kind, sys.implementation.cache_tag or "", sys.version, *parts])
    return text.encode(), digest(text.encode()).hexdigest()


def get(kind, parts):
    """The value stored for (kind, parts), or None (absent, off, unreadable, corrupt or not this key's)."""
    if not enabled():
        return None
    full, name = _key(kind, parts)
    try:
        with open(os.path.join(folder(), name[:2], name), "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = _FORMAT + full + b"\0"
    if not data.startswith(head):
        return None  # damaged, foreign, or another key whose hash collides: computed instead
    try:
        return marshal.loads(data[len(head):])
    except (EOFError, ValueError, TypeError):
        return None


def put(kind, parts, value):
    """Store a marshal-able value; any failure to write is silently given up (the value was computed)."""
    if not enabled():
        return
    full, name = _key(kind, parts)
    path = os.path.join(folder(), name[:2], name)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        data = _FORMAT + full + b"\0" + marshal.dumps(value)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except (OSError, ValueError):
        try:
            os.unlink(temporary)
        except OSError:
            pass


def memo(kind, parts, compute):
    """get, else compute() and put. compute's exceptions propagate, uncached."""
    found = get(kind, parts)
    if found is None:
        found = compute()
        if found is not None:
            put(kind, parts, found)
    return found
