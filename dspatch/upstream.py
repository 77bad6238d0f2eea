"""What is installed upstream: a distribution's release (from its metadata) and a module's source, read without
importing it: definitions found by a quick line scan (checked against a full parse), and the fingerprints the
patches are gated on. dspatch.gating turns these into verdicts.

Nothing here imports torch or a target package (`--check` must be cheap and must work when a target is broken or
absent).
"""
import importlib.machinery
import os
import sys

# ast, tokenize, io, hashlib and re are imported where they are used: with dspatch's cache warm, --check needs none


_versions: dict = {}


def installed_version(distribution):
    """The installed release of a distribution (None: not installed or unreadable metadata), as
    importlib.metadata.version gives it; looked up once per search path."""
    key = (distribution, tuple(sys.path))
    if key not in _versions:
        _versions[key] = _version_from_dist_info(distribution)
    return _versions[key]


def _normal(name):
    """A distribution's name as its dist-info folder spells it (PEP 503: runs of -_. as one _, lower case)."""
    name = name.lower().replace("-", "_").replace(".", "_")
    while "__" in name:
        name = name.replace("__", "_")
    return name


def _version_from_dist_info(distribution):
    """The `Version:` of the first `<name>-<version>.dist-info` on sys.path, read directly: importing
    importlib.metadata (and the email parser it reads metadata with) costs more than all of `--check` else.
    Anything else (an .egg-info, a zip or egg on sys.path, a METADATA without a plain Version line) is left to
    importlib.metadata, so the answer is always the one it gives."""
    wanted = _normal(distribution)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            if os.path.isfile(entry):  # a zip or an egg: importlib.metadata looks inside
                return _metadata_version(distribution)
            continue
        for name in names:
            lowered = name.lower()
            if lowered.endswith(".egg-info") and _normal(lowered.split("-")[0]) == wanted:
                return _metadata_version(distribution)
            if not lowered.endswith(".dist-info") or _normal(lowered[:-10].rpartition("-")[0]) != wanted:
                continue
            try:
                with open(os.path.join(entry or ".", name, "METADATA"), encoding="utf-8") as f:
                    for line in f:
                        if line.startswith("Version:"):
                            return line[len("Version:"):].strip() or _metadata_version(distribution)
                        if not line.strip():
                            break
            except (OSError, ValueError):
                pass
            return _metadata_version(distribution)  # unreadable here: importlib.metadata decides
    return None


def _metadata_version(distribution):
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable metadata (bad bytes, a directory, no permission): a broken install
        return None


def _top_level_spec(name):
    """The spec of a top-level package from the finders on sys.meta_path (editable-install finders
    included), skipping dspatch's own hook. Finding a top-level spec imports nothing."""
    from dspatch._hook import PostImportFinder

    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None or isinstance(finder, PostImportFinder):
            continue
        try:
            spec = find(name, None)
        except Exception:  # a third-party finder's failure must not make --check fail
            continue
        if spec is not None:
            return spec
    return importlib.machinery.PathFinder.find_spec(name)


def module_file(module_name):
    """Path of a module's source without importing it (or its parents); the loaded file if already imported."""
    loaded = sys.modules.get(module_name)
    if loaded is not None and getattr(loaded, "__file__", None):
        return loaded.__file__
    top, _, rest = module_name.partition(".")
    spec = _top_level_spec(top)
    if spec is None:
        return None
    if not spec.submodule_search_locations:
        return spec.origin if not rest else None
    for base in spec.submodule_search_locations:
        path = os.path.join(base, *rest.split(".")) if rest else base
        # a package directory wins over a module file of the same name, as in the import system
        for candidate in (os.path.join(path, "__init__.py"), path + ".py"):
            if os.path.isfile(candidate):
                return candidate
    return None


_parsed: dict = {}
_read: dict = {}


def _stamp(path):
    """What identifies a file's current content within this process: any write changes its ctime."""
    st = os.stat(path)
    return path, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino


def _lines(path):
    """(source, lines as the parser counts them, index of the lines that start a definition, memo of block ends
    for _block_end)."""
    import io

    key = _stamp(path)
    if key not in _read:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        # str.splitlines would also split at \x0c, \x85, \u2028 ...
        lines = [line.rstrip("\r\n") for line in io.StringIO(source, newline=None).readlines()]
        _read[key] = (source, lines, _index(lines), {})
    return _read[key]


def _parse(path):
    import ast

    key = _stamp(path)
    if key not in _parsed:
        source, lines, _, _ = _lines(path)
        _parsed[key] = (lines, ast.parse(source, path))
    return _parsed[key]


# Finding one definition without parsing its whole file (target files run to thousands of lines, and parsing
# them was most of what `--check` cost): the definition is located by its lines, then only its own lines are
# parsed, and the result is trusted only if they parse as exactly that one definition and what stands right
# above it is the previous definition or the enclosing header (nothing that could be part of a decorator).
# Anything else (a header over several lines, a string that breaks the indentation, a statement or a bracket
# right above) answers None and the caller parses the whole file: this makes lookups faster, never different
# (tested on every definition of the standard library and of the stacks' packages).
_DEF = None  # compiled on first use: a warm --check never needs it


def _def_match(line):
    global _DEF
    if _DEF is None:
        import re

        _DEF = re.compile(r"([ \t]*)(?:async[ \t]+def|def|class)[ \t]+(\w+)")
    return _DEF.match(line)


def _index(lines):
    return [(i, m.group(1), m.group(2)) for i, line in enumerate(lines) for m in [_def_match(line)] if m]


def _meaningful(line):
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _width(line):
    return len(line) - len(line.lstrip())


def _block_end(lines, start, ends):
    """Index of the last meaningful line of the block whose header is lines[start]."""
    if start not in ends:
        width, end = _width(lines[start]), start
        for i in range(start + 1, len(lines)):
            if _meaningful(lines[i]):
                # a closing bracket cannot start a statement: it ends a header or an expression over lines
                if _width(lines[i]) <= width and not lines[i].lstrip().startswith((")", "]", "}")):
                    break
                end = i
        ends[start] = end
    return ends[start]


def _quick_segment(lines, qualname, index=None, ends=None):
    """(first line number, lines) of a definition, or None when its lines alone do not tell for sure."""
    node = _quick_node(lines, qualname, index, ends)
    return None if node is None else (first_line(node), lines[first_line(node) - 1:node.end_lineno])


def _quick_node(lines, qualname, index=None, ends=None):
    """A definition's AST node parsed from its own lines, with the file's line numbers and columns (a new one at
    each call), or None when its lines alone do not tell for sure."""
    import ast

    index = _index(lines) if index is None else index
    ends = {} if ends is None else ends
    lo, hi, indent = 0, len(lines), ""
    parts = qualname.split(".")
    for depth, part in enumerate(parts):
        inside = [hit for hit in index if lo <= hit[0] < hi]
        if depth:  # a class body: its own definitions are the least indented ones inside it
            inside = [hit for hit in inside if len(hit[1]) > len(indent)]
            if not inside:
                return None
            indent = min((hit[1] for hit in inside), key=len)
        found = [i for i, ws, name in inside if ws == indent and name == part]
        if not found:
            return None
        start = found[-1]  # the last one binds the name
        lo, hi = start + 1, _block_end(lines, start, ends) + 1
    first = start
    for i in range(start - 1, -1, -1):  # decorators: '@' lines at the definition's indentation right above it
        line = lines[i]
        if not _meaningful(line) or _width(line) > len(indent):
            continue
        if _width(line) == len(indent) and line.lstrip().startswith("@"):
            first = i
        elif _width(line) < len(indent) or _def_match(line):
            break  # the enclosing header, or the previous definition
        elif _decorator_above(lines, i, indent):
            return None  # a statement or a bracket that could be part of a decorator
        else:
            break  # a statement: no decorator starts above it before the previous definition
    # blank lines first, so that the file's line numbers come out; an indented definition parses as the body of
    # `if 1:`, on the line above it (a class header stands there)
    head = "\n" * (first - 1) + "if 1:\n" if indent else "\n" * first
    try:
        tree = ast.parse(head + "\n".join(lines[first:hi]) + "\n")
    except (SyntaxError, ValueError):
        return None
    body = tree.body[0].body if indent else tree.body
    if len(tree.body) != 1 or len(body) != 1 or getattr(body[0], "name", None) != parts[-1] \
            or not isinstance(body[0], (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return body[0]


def _decorator_above(lines, i, indent):
    """Whether a line at `indent` that starts with '@' stands above line i, below the previous definition or
    the enclosing header: only then can the lines between be a decorator's (a decorator starts with '@')."""
    for j in range(i, -1, -1):
        line = lines[j]
        if not _meaningful(line) or _width(line) > len(indent):
            continue
        if _width(line) < len(indent):
            return False  # the enclosing header
        if line.lstrip().startswith("@"):
            return True
        if _def_match(line):
            return False  # the previous definition: any '@' above it is its own
    return False


def own_definition(path, qualname):
    """A new AST node of a definition (the caller's to change), with the file's own line numbers and columns,
    parsed from the definition's lines alone where they tell for sure (see _quick_segment); None otherwise
    (then copy the whole file's node)."""
    _, lines, index, ends = _lines(path)
    return _quick_node(lines, qualname, index, ends)


def first_line(node):
    """A definition's first line: its first decorator's, if it has any."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])


def find_definition(tree, qualname):
    """The definition `qualname` names: the last one of that name in its scope, as Python binds it."""
    import ast

    node = tree
    for part in qualname.split("."):
        found = [child for child in getattr(node, "body", ())
                 if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == part]
        if not found:
            return None
        node = found[-1]
    return node


def definition(path, qualname):
    """The AST node of a definition in a source file (shared, cached: copy before changing it)."""
    return find_definition(_parse(path)[1], qualname)


def source_segment(path, qualname):
    """(first line number, lines) of a definition, decorators included; None when it is not there."""
    _, lines, index, ends = _lines(path)
    quick = _quick_segment(lines, qualname, index, ends)
    if quick is not None:
        return quick
    lines, tree = _parse(path)
    node = find_definition(tree, qualname)
    return None if node is None else (first_line(node), lines[first_line(node) - 1:node.end_lineno])


def code_tokens(text):
    """The tokens of some source that carry meaning: no comments, no blank or wrapped-line breaks, no
    indentation widths (block structure is kept as INDENT/DEDENT marks), string literals by value (quotes,
    prefixes and implicit concatenation normalised). The same for every Python version: f-strings, which
    Python 3.12 splits into parts, are kept as their source text."""
    import ast
    import io
    import tokenize

    lines = text.splitlines(keepends=True)
    out, depth, start = [], 0, None
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        kind = tok.type
        if fstring_start is not None and kind == fstring_start:
            start = tok.start if depth == 0 else start
            depth += 1
            continue
        if fstring_end is not None and kind == fstring_end:
            depth -= 1
            if depth == 0:
                (row0, col0), (row1, col1) = start, tok.end
                raw = "".join(lines[row0 - 1:row1])
                out.append(("s", raw[col0:len(raw) - len(lines[row1 - 1]) + col1]))
            continue
        if depth or kind in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER):
            continue
        if kind == tokenize.NEWLINE:
            out.append(("n", ""))
        elif kind == tokenize.INDENT:
            out.append(("i", ""))
        elif kind == tokenize.DEDENT:
            out.append(("d", ""))
        elif kind == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # an f-string before 3.12: its text
                out.append(("s", tok.string))
                continue
            if out and out[-1][0] == "v" and type(out[-1][1]) is type(value):
                out[-1] = ("v", out[-1][1] + value)  # "a" "b" is "ab"
            else:
                out.append(("v", value))
        else:
            out.append(("t", tok.string))
    while out and out[0][0] == "i":  # the definition's own nesting level
        out.pop(0)
    while out and out[-1][0] == "d":
        out.pop()
    return [kind + (repr(value) if kind == "v" else value) for kind, value in out]


def fingerprint_lines(lines):
    """Hash of a definition's code tokens (see code_tokens): blind to comments, blank lines, line wrapping,
    indentation widths and string quoting, which releases and forks change without changing behaviour; not
    blind to any change of code (docstrings included), nor dependent on the Python version reading it."""
    import hashlib

    return hashlib.sha256("\x1f".join(code_tokens("\n".join(lines) + "\n")).encode()).hexdigest()[:16]


def fingerprint(path, qualname):
    """The fingerprint of a definition in a file (None when it is not there); from dspatch's cache when this
    file's content was fingerprinted before by this code (see dspatch._cache)."""
    from dspatch import _cache

    def compute():
        seg = source_segment(path, qualname)
        return None if seg is None else fingerprint_lines(seg[1])

    return _cache.memo("fingerprint", [_cache.code_hash(sys.modules[__name__]), _cache.content_hash(path), qualname],
                       compute)


def definition_lines(path, qualname):
    """(first line, `def` line) of a definition: its first decorator's line and its own (the same without
    decorators); None when it is not there. What a compiled function's co_firstlineno can be."""
    from dspatch import _cache

    def compute():
        seg = source_segment(path, qualname)
        if seg is None:
            return None
        first, lines = seg
        name = qualname.rsplit(".", 1)[-1]
        width = _width(lines[0])
        for offset, line in enumerate(lines):
            found = _def_match(line)
            if found and found.group(2) == name and len(found.group(1)) == width:
                return first, first + offset
        return None

    return _cache.memo("lines", [_cache.code_hash(sys.modules[__name__]), _cache.content_hash(path), qualname],
                       compute)
