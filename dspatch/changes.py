"""The two kinds of change a patch makes to upstream, each undone on its own (dspatch._runtime.Transaction records
them): a function's code rebuilt in place, or a wrapper installed on an attribute; and the wrapper's type."""


def lookup(module, qualname):
    """The object `qualname` names in `module` now (how a patched function or wrapper pickles: by name, as
    a plain function does)."""
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_wrapper_class = None


def wrapper_type():
    """wrapt.FunctionWrapper that copies and pickles like the function it wraps (by reference), so a patched
    method behaves as a stock one under copy, deepcopy and pickle (wrapt's proxies refuse by default)."""
    global _wrapper_class  # a type made once, on first use (wrapt imported only when a patch applies)
    if _wrapper_class is None:
        import wrapt

        def by_name(self):
            instance = getattr(self, "_self_instance", None)
            if instance is not None:  # a bound method pickles as getattr(instance, name), as stock
                return getattr, (instance, self.__name__)
            return lookup, (self.__module__, self.__qualname__)

        def same(self, *memo):
            return self

        members = {"__reduce__": by_name, "__reduce_ex__": lambda self, protocol: by_name(self),
                   "__copy__": same, "__deepcopy__": same}
        bound = type("BoundPatchWrapper", (wrapt.BoundFunctionWrapper,), dict(members))
        _wrapper_class = type("PatchWrapper", (wrapt.FunctionWrapper,),
                              dict(members, __bound_function_wrapper__=bound))
    return _wrapper_class


class CodeChange:
    """A function object of upstream's whose `__code__` was swapped for a rebuilt one. Undone by swapping it
    back, whoever holds the function (the class, decorators, another tool's wrapper) and wherever."""

    def __init__(self, target, function, old, new):
        self.target, self.function, self.old, self.new = target, function, old, new

    def describe(self):
        return f"{self.target}: code rebuilt in place"

    def intact(self, txn):
        owner, name, value = txn.resolve(self.target)
        from dspatch.rewrite import upstream_function

        return upstream_function(value, self.target, self.function.__code__.co_filename) is self.function \
            and self.function.__code__ is self.new

    def blocked(self):
        return None if self.function.__code__ is self.new else f"{self.target}"

    def undo(self):
        if self.function.__code__ is self.new:  # never undo someone else's later change (revert checks first)
            self.function.__code__ = self.old


class AttributeChange:
    """A wrapper installed on a class or module attribute, on top of whatever was there."""

    def __init__(self, target, owner, name, previous, installed, switch):
        self.target, self.owner, self.name = target, owner, name
        self.previous, self.installed, self.switch = previous, installed, switch

    def describe(self):
        return f"{self.target}: wrapped"

    def intact(self, txn):
        return vars(self.owner).get(self.name) is self.installed and txn.resolve(self.target)[0] is self.owner

    def blocked(self):
        return None  # a wrapper can always be switched to a pass-through

    def undo(self):
        self.switch["on"] = False  # from now on the wrapper only forwards, wherever it still sits
        if vars(self.owner).get(self.name) is self.installed:
            setattr(self.owner, self.name, self.previous)
        # else another tool wrapped ours since: it stays, and ours inside it is a plain pass-through now
