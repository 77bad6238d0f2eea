"""Derive a fixed function from the *installed* source, for fixes no wrapper can express (an attribute
renamed across several methods). Gated by the target's fingerprint, so the source it rewrites is exactly
a released one; nothing from upstream is stored in dspatch.
"""
import __future__
import ast
import sys
import types

from dspatch import gating
from dspatch import upstream


class RewriteError(RuntimeError):
    pass


def _functions_in(obj, depth=4):
    """Plain functions reachable from a (possibly decorated) callable: itself, __wrapped__, __func__, closures.
    Decorators such as deepspeed's instrument_w_nvtx keep the function only in a closure cell."""
    seen, todo = [], [(obj, 0)]
    while todo:
        item, level = todo.pop()
        if item is None or any(item is s for s in seen) or level > depth:
            continue
        seen.append(item)
        todo += [(getattr(item, "__wrapped__", None), level + 1), (getattr(item, "__func__", None), level + 1)]
        for cell in getattr(item, "__closure__", None) or ():
            try:
                todo.append((cell.cell_contents, level + 1))
            except ValueError:  # empty cell
                pass
    # real functions only: a proxy (wrapt's) answers __code__ for the function it wraps, which it is not
    return [f for f in seen if type(f) is types.FunctionType]


def copy_tree(node):
    """A deep copy of an AST (nodes and lists new, leaf values shared: they are immutable), several times
    faster than copy.deepcopy, which a cold start pays once per rebuilt function."""
    if isinstance(node, ast.AST):
        new = type(node).__new__(type(node))
        new.__dict__.update((key, copy_tree(value)) for key, value in node.__dict__.items())
        return new
    if isinstance(node, list):
        return [copy_tree(item) for item in node]
    return node


def rebuild(target, transform, original, decorators=True):
    """Compile `target` from its module's source file after `transform(def_node)` edits its AST.

    The definition is compiled inside the same chain of class names, so private `self.__x` names mangle as
    upstream's do; decorators are re-applied from the module's own globals (`decorators=False`: not run,
    each replaced by an identity at its own line, for callers that need only the code); `__class__` is the
    real class;
    line numbers stay those of the installed file (tracebacks point at real lines); and mutable defaults
    (deepspeed's `count=[0]`) are the original's own objects, shared, not reset."""
    module = sys.modules[target.module]
    # a copy of the definition's node from the installed file: line numbers, strings and columns as upstream's
    definition = upstream.own_definition(module.__file__, target.qualname) or \
        copy_tree(upstream.definition(module.__file__, target.qualname))
    *classes, name = target.qualname.split(".")
    flags = sum(f.compiler_flag for f in vars(module).values() if isinstance(f, __future__._Feature))
    _refuse_class_scope_names(module.__file__, classes, definition, flags)
    transform(definition)
    if not decorators and definition.decorator_list:  # co_firstlineno stays the first decorator's line
        first = definition.decorator_list[0]
        identity = ast.parse("lambda f: f", mode="eval").body
        for node in ast.walk(identity):
            if "lineno" in node._attributes:
                ast.copy_location(node, first)
        definition.decorator_list = [identity]
    body = [definition]
    for cls in reversed(classes):
        holder = ast.parse(f"class {cls}:\n    pass").body[0]
        holder.body = body
        body = [holder]
    tree = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(tree)
    # the module's own `from __future__` features (annotations!) apply to the copy as to the original
    namespace = {}
    exec(compile(tree, module.__file__, "exec", flags=flags, dont_inherit=True), vars(module), namespace)
    rebuilt = namespace[classes[0] if classes else name]
    for cls in classes[1:]:
        rebuilt = vars(rebuilt)[cls]
    if classes:
        rebuilt = vars(rebuilt)[name]
    owner = module
    for cls in classes:
        owner = getattr(owner, cls)
    fresh = _the_function(rebuilt, name, module.__file__, target)
    old = _the_function(original, name, module.__file__, target)
    fresh.__defaults__, fresh.__kwdefaults__ = old.__defaults__, old.__kwdefaults__
    if "__class__" in fresh.__code__.co_freevars:
        # `__class__` (explicit, or through zero-argument super()) must name the real class, not the holder
        cell = fresh.__closure__[fresh.__code__.co_freevars.index("__class__")]
        cell.cell_contents = owner
    return rebuilt


def _refuse_class_scope_names(path, classes, definition, flags):
    """Decorators, defaults and (evaluated) annotations run in the class body upstream, but in module scope
    in the copy: refuse a definition whose expressions name something the class body binds."""
    if not classes:
        return
    args = definition.args
    evaluated = [*definition.decorator_list, *args.defaults, *[d for d in args.kw_defaults if d is not None]]
    if not flags & __future__.annotations.compiler_flag:
        evaluated += [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg,
                                             args.kwarg) if a is not None and a.annotation is not None]
        evaluated += [definition.returns] if definition.returns is not None else []
    names = {n.id for expr in evaluated for n in ast.walk(expr) if isinstance(n, ast.Name)}
    if not names:
        return  # nothing to look up in the class body (which would mean parsing it)
    owner = upstream.definition(path, ".".join(classes))
    bound = set()
    for node in owner.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                bound |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    used = names & bound
    if used:
        raise RewriteError(f"{'.'.join(classes)}.{definition.name}: its decorators/defaults use class-body "
                           f"names {sorted(used)}, which a rebuilt copy cannot see")


def upstream_function(obj, target, filename):
    """The function object compiled from the target's own definition, inside whatever now sits at its
    attribute: upstream's decorators, and wrappers other tools put around it (profilers, tracers, users'
    monkeypatches; wrapt and functools.wraps keep it reachable). RewriteError, naming what sits there,
    when the definition cannot be reached: something replaced it without keeping it."""
    name = target.qualname.rsplit(".", 1)[-1]
    lines = upstream.definition_lines(filename, target.qualname) or ()
    found = [f for f in _functions_in(obj, depth=8) if f.__code__.co_name == name
             and f.__code__.co_filename == filename and f.__code__.co_firstlineno in lines]
    if len(found) != 1:
        raise RewriteError(f"{target} is {_describe(obj)}, from which deepspeed's own function cannot be reached "
                           f"(replaced by another patcher?): the fix would not run")
    return found[0]


def _describe(obj):
    kind = type(obj)
    where = getattr(obj, "__module__", None) or kind.__module__
    return f"a {kind.__module__}.{kind.__qualname__} ({getattr(obj, '__qualname__', repr(obj)[:60])} from {where})"


def same_code(a, b):
    """Whether code `a` is, by its signature and the names it uses, the code `b` compiled from the same
    definition. (Bytecode is no test: a module's cached bytecode and a fresh compile of the same source can
    differ in layout.) A tool's trampoline installed as a function's code uses other names."""
    fields = ("co_name", "co_firstlineno", "co_argcount", "co_kwonlyargcount", "co_names", "co_varnames",
              "co_freevars", "co_cellvars")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def rebuild_code(target, transform, function):
    """The code object of `function` (upstream's own, see upstream_function) recompiled from its module's
    source after `transform`. Installed as `function.__code__`, it changes what every reference to the
    function runs (the class attribute, upstream's decorators, anyone's wrapper around it) while the
    function object, its defaults, closure (`__class__`), name and identity stay upstream's.

    From dspatch's cache when this code of dspatch (gating, rewrite, the transform's module) rebuilt this
    target from a file with these very bytes before, on this Python (see dspatch._cache)."""
    from dspatch import _cache

    key = _cache_key(target, transform)
    compute = lambda: _rebuilt_code(target, transform, function)  # noqa: E731
    code = compute() if key is None else _cache.memo("rebuilt", key, compute)
    if code.co_freevars != function.__code__.co_freevars:
        raise RewriteError(f"{target}: the rebuilt code needs the free variables {code.co_freevars}, the installed "
                           f"function has {function.__code__.co_freevars}")
    return code


def _rebuilt_code(target, transform, function):
    rebuilt = rebuild(target, transform, function, decorators=False)
    return _the_function(rebuilt, function.__code__.co_name, function.__code__.co_filename, target).__code__


_PLAIN = (str, int, float, bool, type(None), bytes)


def _cache_key(target, transform):
    """What a rebuilt code object depends on, or None when that cannot be told (then it is not cached): the
    target file's bytes and path, the target, the transform (its module's source, its name, the values it closes
    over) and dspatch's rebuilding code."""
    from dspatch import _cache

    module = sys.modules.get(getattr(transform, "__module__", None) or "")
    cells = []
    for cell in getattr(transform, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            value = None
        if not isinstance(value, _PLAIN) and not (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
            return None
        cells.append(repr(value))
    if module is None or not getattr(module, "__file__", None):
        return None
    try:
        path = sys.modules[target.module].__file__  # the code carries it (co_filename): part of what it is
        return [_cache.code_hash(gating, sys.modules[__name__], module), _cache.content_hash(path), path,
                target.module, target.qualname,
                f"{transform.__module__}.{transform.__qualname__}", *cells]
    except OSError:
        return None


def _the_function(obj, name, filename, target):
    """The function object compiled from the definition inside a decorated callable."""
    for f in _functions_in(obj):
        code = f.__code__
        if code.co_name == name and code.co_filename == filename:
            return f
    raise RewriteError(f"cannot find the function {name} inside the decorated {target}")


# ----------------------------------------------------------------------------------------------------
# Building blocks of transforms: find exactly the site a fix changes, and place new nodes at upstream's line.

def at_line(node, where):
    """`node` and everything in it placed at `where`'s position, so that a traceback through new code points at
    the upstream line it stands in for."""
    for sub in ast.walk(node):
        if "lineno" in sub._attributes:
            ast.copy_location(sub, where)
    return node


def expression(text, where):
    """An expression parsed from `text`, placed at `where`'s line."""
    return at_line(ast.parse(text, mode="eval").body, where)


def statement(text, where):
    """One statement (it may hold a block) parsed from `text`, placed at `where`'s line."""
    return at_line(ast.parse(text).body[0], where)


def call_into(module, function):
    """Source of an expression that reaches `module.function` from rebuilt upstream code without adding a name
    to upstream's module: builtins only (`__import__` of an imported module is a sys.modules lookup)."""
    return f"__import__({module!r}, fromlist=({function!r},)).{function}"


def matches(node, pattern):
    """Whether `node` has the shape of `pattern` (source text of an expression or a statement, or its AST):
    the same node types, names, attributes and constants, positions and load/store contexts aside. In the
    pattern `_` stands for any one node and a call written `f(...)` takes any arguments."""
    if isinstance(pattern, str):
        tree = ast.parse(pattern)
        only = tree.body[0]
        pattern = only.value if isinstance(only, ast.Expr) and len(tree.body) == 1 else only
    return _same(node, pattern)


def _same(node, pattern):
    if isinstance(pattern, ast.Name) and pattern.id == "_":
        return isinstance(node, ast.AST)
    if type(node) is not type(pattern):
        return False
    any_arguments = isinstance(pattern, ast.Call) and len(pattern.args) == 1 and not pattern.keywords \
        and isinstance(pattern.args[0], ast.Constant) and pattern.args[0].value is Ellipsis
    for field in pattern._fields:
        if field == "ctx" or (any_arguments and field in ("args", "keywords")):
            continue
        mine, theirs = getattr(node, field, None), getattr(pattern, field, None)
        if isinstance(theirs, list):
            if not isinstance(mine, list) or len(mine) != len(theirs) \
                    or not all(_same(a, b) if isinstance(b, ast.AST) else a == b for a, b in zip(mine, theirs)):
                return False
        elif isinstance(theirs, ast.AST):
            if not _same(mine, theirs):
                return False
        elif mine != theirs:
            return False
    return True


def _predicate(match):
    return match if callable(match) else (lambda node: matches(node, match))


def find_all(root, match):
    """Every node under `root` that `match` (a pattern for `matches`, or a predicate) accepts, in walk order."""
    accept = _predicate(match)
    return [node for node in ast.walk(root) if accept(node)]


def find_one(root, match, what=None):
    """The one node under `root` that `match` accepts; RewriteError naming `what` (default: the pattern) when
    there is none or more than one: the installed code is not the shape the fix was written for."""
    found = find_all(root, match)
    if len(found) != 1:
        raise RewriteError(f"{getattr(root, 'name', type(root).__name__)}: expected exactly one {what or match}, "
                           f"found {len(found)}")
    return found[0]


def find_statement(root, match, what=None):
    """(block, index) of the one statement under `root` that `match` accepts, in the list that holds it (a body,
    an else branch...): where a fix puts statements around it or replaces it."""
    accept = _predicate(match)
    found = [(block, index) for parent in ast.walk(root) for field in ("body", "orelse", "finalbody")
             for block in [getattr(parent, field, None)] if isinstance(block, list)
             for index, stmt in enumerate(block) if isinstance(stmt, ast.stmt)
             and (accept(stmt) or isinstance(stmt, ast.Expr) and accept(stmt.value))]  # `f(x)` alone: its call
    if len(found) != 1:
        raise RewriteError(f"{getattr(root, 'name', type(root).__name__)}: expected exactly one statement "
                           f"{what or match}, found {len(found)}")
    return found[0]


def replace(root, old, new):
    """Put `new` where the node `old` sits under `root` (a field or an item of a list); RewriteError if it is
    not there."""
    for parent in ast.walk(root):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(item is old for item in value):
                value[[i for i, item in enumerate(value) if item is old][0]] = new
                return
    raise RewriteError(f"{getattr(root, 'name', type(root).__name__)}: the node to replace is not in it")


def rename_attribute(old, new):
    """A transform: every `x.<old>` in the definition becomes `x.<new>`; fails if there is none."""

    def transform(definition):
        count = 0
        for node in ast.walk(definition):
            if isinstance(node, ast.Attribute) and node.attr == old:
                node.attr = new
                count += 1
        if not count:
            raise RewriteError(f"{definition.name} has no .{old} to rename")

    return transform
