"""Applies patches in this process: each one whole or not at all, once, revertibly.

Loaded on the first import of a watched package (or by dspatch.apply()); imports wrapt only when a patch
actually applies.
"""
import os
import sys
import threading

from dspatch import _hook, gating, registry
from dspatch.changes import AttributeChange, CodeChange, lookup, wrapper_type  # noqa: F401 (lookup: by name in pickles)

class _State:
    """What this process has selected, applied and said: one object, guarded by its one lock."""

    def __init__(self):
        self.lock = threading.RLock()
        self.active = False  # a selection was made and the import hook is installed
        self.strict = False  # DSPATCH_STRICT=1 or dspatch.apply(strict=True): a failure raises
        self.pending = {}  # id -> Patch selected, waiting for its target modules to finish importing
        self.applied = {}  # id -> Transaction
        self.superseded = {}  # id -> [Transaction]: still in force on class objects a reload replaced (others hold them)
        self.outcome = {}  # id -> (verdict, reason) decided in this process
        self.reported = set()  # messages said once
        self.strict_failures = {}  # id -> message: under DSPATCH_STRICT=1 every later import of its modules fails too
        self.unsaid = []  # patches applied since the last summary line
        self.seen = set()  # watched modules whose import passed the hook


state = _State()


class PatchError(RuntimeError):
    """A patch could not apply and DSPATCH_STRICT=1 asked for that to be an error."""


def _strict_error(message, cause=None):
    """The PatchError strict mode raises. Uncaught (the job's end), it prints as its one line of text, not as a
    traceback through the import machinery and dspatch's frames: the user's job is what failed, for this reason."""
    previous = sys.excepthook
    if not getattr(previous, "dspatch_quiet", False):
        def excepthook(kind, value, tb):
            if isinstance(value, PatchError):
                print(str(value), file=sys.stderr, flush=True)
            else:
                previous(kind, value, tb)

        excepthook.dspatch_quiet = True
        sys.excepthook = excepthook
    error = PatchError(message)
    error.__cause__ = cause
    error.__suppress_context__ = True
    return error


def _say(message):
    # Quiet by default: local rank 0 only (one line per node), every rank with DSPATCH_VERBOSE=1.
    if os.environ.get("LOCAL_RANK", "0") in ("", "0") or _hook.flag("DSPATCH_VERBOSE"):
        print(f"dspatch: {message}", file=sys.stderr, flush=True)


def _report(key, message):
    if key not in state.reported:
        state.reported.add(key)
        _say(message)




def _flush_applied(just_loaded=None):
    """One line for the patches applied during one top-level import (`import deepspeed` applies several)."""
    if state.unsaid and not any(top in sys.modules and not _module_ready(top, just_loaded) for top in _hook.WATCHED):  # not while a watched package (deepspeed importing transformers...) is loading
        _say("applied " + ", ".join(state.unsaid))
        state.unsaid.clear()


def state_of(pid):
    with state.lock:
        if state.active:
            try:
                _catch_up()
            except PatchError:  # strict: recorded as the verdict; raised at the next watched import
                pass
        return state.outcome.get(pid)


def applied_ids():
    return list(state.applied)


def in_force(pid):
    """Whether patch `pid` is applied here, whole: not while a proof leaves one of its targets out
    (dspatch.verify --leave-out-each sets `left_out` on the patch for that time)."""
    txn = state.applied.get(pid)
    return txn is not None and txn.intact() and getattr(txn.patch, "left_out", None) is None


def _module_ready(name, just_loaded=None):
    # The module the hook just reported has executed but is still flagged as initialising until the
    # import system finishes with it; any other module counts once it is fully imported (now, not ever).
    if name == just_loaded:
        return True
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def notify(name):
    """The import hook's callback: a failure of dspatch never breaks the user's import (unless strict)."""
    try:
        module_loaded(name)
    except Exception as e:
        _hook.report_failure(name, e, state.strict)


def module_loaded(name):
    """Called by the import hook after a module of a watched package has executed."""
    with state.lock:
        state.seen.add(name)
        if not state.active:
            activate(None, None, just_loaded=name)
        else:
            _requeue_if_reloaded(name)
            _apply_ready(name)
        _catch_up(just_loaded=name)
        _flush_applied(name)
        if name == LAUNCHER:
            forward_to_nodes()
        if state.strict:
            top = name.partition(".")[0]
            for key, message in state.strict_failures.items():  # every later import of that package fails too
                if key == SELECTION or registry.all_patches()[key].modules[0].partition(".")[0] == top:
                    raise _strict_error(message)


SELECTION = "selection"  # key of a bad DSPATCH/DSPATCH_DISABLE in state.strict_failures: every import fails


def _catch_up(just_loaded=None):
    """A pending patch whose modules are all imported, yet it did not apply when the last of them loaded,
    was bypassed: a finder ahead of dspatch's on sys.meta_path imported them without our loader. Say so;
    apply it late (its in-use check still guards live objects); under strict, fail."""
    for pid, patch in list(state.pending.items()):
        if not all(_module_ready(m, just_loaded) for m in patch.modules):
            continue
        missed = [m for m in patch.modules if m not in state.seen]
        if not missed:
            continue
        loader = type(getattr(getattr(sys.modules.get(missed[0]), "__spec__", None), "loader", None))
        del state.pending[pid]
        reason = (f"{', '.join(missed)} imported without passing dspatch's import hook (loader "
                  f"{loader.__module__}.{loader.__qualname__}: a finder ahead of dspatch's on sys.meta_path)")
        if state.strict:
            return _fail(patch, gating.FAILED, f"not applied: {reason}", f"{pid} not applied: {reason}")
        _report(("bypass", pid), f"{pid}: {reason}; applying it late")
        _apply_one(patch, late=True)


# The multi-node DeepSpeed launcher (`deepspeed --hostfile ...`, also behind `accelerate launch`) passes on
# only variables whose names start with an entry of EXPORT_ENVS (plus .deepspeed_env). It reads the list at
# launch time, so adding the prefix here makes DSPATCH, DSPATCH_DISABLE and DSPATCH_STRICT reach every node.
LAUNCHER = "deepspeed.launcher.runner"


def forward_to_nodes():
    runner = sys.modules.get(LAUNCHER)
    exports = getattr(runner, "EXPORT_ENVS", None)
    if "DSPATCH" in os.environ and isinstance(exports, list) and "DSPATCH" not in exports:
        exports.append("DSPATCH")


def activate(ids, strict, just_loaded=None):
    """Select patches (code or environment), hook future imports, and apply what is importable now."""
    with state.lock:
        state.strict = _hook.strict() if strict is None else bool(strict)
        try:  # a bad selection leaves the state as it was (a typo in code does not switch DSPATCH=1 off)
            chosen, _ = registry.selection(ids)
        except registry.SelectionError as e:
            if state.strict:  # and so fails every later import of a watched package, not only the first
                state.strict_failures[SELECTION] = f"dspatch: {e}. Nothing applied; strict mode (DSPATCH_STRICT=1) stops the job."
                raise _strict_error(state.strict_failures[SELECTION])
            _report(("selection", str(e)), f"{e}. Nothing applied.")
            return {}
        state.strict_failures.pop(SELECTION, None)
        if ids is None:
            _say_what_does_not_apply(registry.named())
        state.active = True
        _hook.install(notify)
        patches = registry.all_patches()
        for pid in chosen:
            if pid not in state.applied:
                state.outcome.pop(pid, None)
                state.pending[pid] = patches[pid]
        _apply_ready(None, late=just_loaded is None, just_loaded=just_loaded)
        _flush_applied(just_loaded)
        if _module_ready(LAUNCHER, just_loaded):
            forward_to_nodes()
        return {pid: state.outcome.get(pid, ("pending", f"waiting for {', '.join(patches[pid].modules)}"))
                for pid in chosen}


def _say_what_does_not_apply(pids):
    """One line for each patch DSPATCH names by its id that does not apply here (its verdict and why)."""
    patches = registry.all_patches()
    for pid in pids:
        found = gating.evaluate(patches[pid])
        if found.verdict not in (gating.APPLIES, gating.DRIFTED):  # drift is said when the patch is tried
            _report(("named", pid), f"DSPATCH names {pid}, which does not apply here: {found.verdict} "
                                    f"({found.reason})")


def _requeue_if_reloaded(name):
    # A reload (or a fresh import after sys.modules was purged) re-executes a module: its classes are new,
    # unpatched objects, while other modules still hold the old ones. Keep the old ones patched (so
    # nothing mixes the two numberings) and patch the new ones too.
    for pid, txn in list(state.applied.items()):
        if name in txn.patch.modules and not txn.intact():
            state.superseded.setdefault(pid, []).append(txn)
            del state.applied[pid]
            state.outcome.pop(pid, None)
            state.pending[pid] = txn.patch


def _apply_ready(trigger, late=False, just_loaded=None):
    """Apply pending patches whose modules have all finished importing. `late`: they finished before
    activation, so upstream objects may already be in use."""
    just_loaded = just_loaded or trigger
    for pid, patch in list(state.pending.items()):
        if trigger is not None and trigger not in patch.modules:
            continue
        if all(_module_ready(m, just_loaded) for m in patch.modules):
            del state.pending[pid]
            _apply_one(patch, late)


def _fail(patch, verdict, reason, message, cause=None):
    state.outcome[patch.id] = (verdict, reason)
    if state.strict:
        state.strict_failures[patch.id] = f"dspatch: {patch.id}: {reason}; strict mode (DSPATCH_STRICT=1) stops the job."
        raise _strict_error(state.strict_failures[patch.id], cause)
    _report(patch.id, message)


def _apply_one(patch, late=False):
    found = gating.evaluate(patch)
    version, verdict, reason = found.version, found.verdict, found.reason
    if verdict == gating.DRIFTED:
        return _fail(patch, verdict, reason, f"{patch.id} skipped: {reason}")
    if verdict != gating.APPLIES:
        state.outcome[patch.id] = (verdict, reason)
        return
    try:
        busy = patch.in_use() if late and patch.in_use else None
    except Exception as e:  # the verdict must stay the truth whatever happens
        busy = f"could not tell whether live objects depend on it ({type(e).__name__}: {e})"
    if busy:
        reason = f"not applied: {busy}"
        return _fail(patch, gating.FAILED, reason, f"{patch.id} {reason}")
    txn = Transaction(patch)
    try:
        patch.apply(txn)
    except BaseException as e:
        txn.rollback()
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: nothing left half-applied, then go on
            state.outcome[patch.id] = (gating.FAILED, f"interrupted ({type(e).__name__}); left out whole")
            raise
        reason = f"{type(e).__name__}: {e}; left out whole, nothing changed"
        return _fail(patch, gating.FAILED, reason,
                     f"{patch.id} could not apply to {patch.distribution} {version}: {reason}", e)
    state.applied[patch.id] = txn
    state.strict_failures.pop(patch.id, None)
    state.outcome[patch.id] = (gating.APPLIED, f"applied in this process to {patch.distribution} {version}")
    state.unsaid.append(f"{patch.id} ({patch.distribution} {version})")


def revert(ids=None, force=False):
    """Undo applied patches; with no ids, also stop watching imports. A patch whose `in_use()` says live
    objects depend on it is not reverted (RuntimeError) unless `force`."""
    with state.lock:
        wanted = list(dict.fromkeys([*state.applied, *state.superseded])) if ids is None else registry._resolve_tokens(
            registry.split(ids) if isinstance(ids, str) else list(ids), "dspatch.revert()")
        busy = {}
        for pid in wanted:
            if pid in state.applied and state.applied[pid].patch.in_use and not force:
                try:
                    busy[pid] = state.applied[pid].patch.in_use()
                except Exception as e:
                    busy[pid] = f"could not tell whether live objects depend on it ({type(e).__name__}: {e})"
        busy = {pid: why for pid, why in busy.items() if why}
        if busy:
            raise RuntimeError("dspatch: not reverted, " + "; ".join(f"{p}: {w}" for p, w in busy.items())
                               + " (revert(force=True) if they will not be used again)")
        # whole or not at all: a function whose code another tool swapped since cannot get upstream's back
        blocked = [c for pid in wanted for t in [state.applied.get(pid), *state.superseded.get(pid, [])] if t is not None
                   for c in t.blocked()]
        if blocked:
            raise RuntimeError("dspatch: not reverted, nothing changed: another tool has replaced the code of "
                               + "; ".join(blocked) + " since dspatch patched it (undo theirs first)")
        done = []
        for pid in wanted:
            state.pending.pop(pid, None)
            state.strict_failures.pop(pid, None)
            txn = state.applied.pop(pid, None)
            if txn is not None:
                txn.rollback()
                done.append(pid)
            for old in reversed(state.superseded.pop(pid, [])):
                old.rollback()
            state.outcome.pop(pid, None)
        if ids is None:
            state.pending.clear()
            _hook.uninstall()
            state.active = False
        return done


class Transaction:
    """The changes one patch makes, recorded so that they can be undone together.

    Two ways to change a target, both of which keep other patchers' work (profilers, tracers, users' own
    monkeypatches, before or after dspatch) in force: `recode` changes upstream's function object in place,
    `wrap` puts a wrapper on top of whatever the attribute holds. Undoing either is always whole."""

    def __init__(self, patch):
        self.patch = patch
        self._undo = []

    def target(self, qualname):
        for t in self.patch.targets:
            if t.qualname == qualname:
                return t
        raise KeyError(qualname)

    def has(self, qualname):
        """Whether this release has the target (a Target declared with `releases` is absent from the others)."""
        return any(t.qualname == qualname for t in self.patch.targets)

    def resolve(self, target):
        """(owner, attribute name, value) of a target in its imported module; where an earlier transaction
        of this patch still wraps it (after a reload elsewhere), the value behind that wrapper."""
        owner = sys.modules[target.module]
        *path, name = target.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = vars(owner)[name]
        for old in state.superseded.get(self.patch.id, ()):
            for change in old._undo:
                if isinstance(change, AttributeChange) and change.installed is raw:
                    return owner, name, change.previous
        return owner, name, raw

    def recode(self, target, transform):
        """Rebuild the target's code from the installed source with `transform` (see dspatch.rewrite) and
        install it in upstream's own function object. Returns that function."""
        from dspatch.rewrite import RewriteError, rebuild_code, same_code, upstream_function

        _, _, value = self.resolve(target)
        function = upstream_function(value, target, sys.modules[target.module].__file__)
        if not any(change.function is function for old in state.superseded.get(self.patch.id, ())
                   for change in old._undo if isinstance(change, CodeChange)):
            # a code-swapping tool (ddtrace's wrapping does this) got there first: its trampoline would be lost
            if not same_code(function.__code__, rebuild_code(target, lambda node: None, function)):
                raise RewriteError(f"{target}: its code is not the one its source compiles to (another tool "
                                   f"replaced it in place); left out rather than drop that tool's change")
        new = rebuild_code(target, transform, function)
        self._undo.append(CodeChange(target, function, function.__code__, new))
        function.__code__ = new
        return function

    def wrap(self, target, wrapper):
        """Install a wrapt-style wrapper (wrapper(wrapped, instance, args, kwargs)) on the target, on top of
        whatever sits there now; returns that. Reverted, it is removed, or if another tool has wrapped it
        since, turned into a pass-through so that the other tool's wrapper keeps working."""
        owner, name, current = self.resolve(target)
        switch = {"on": True}

        def call(wrapped, instance, args, kwargs):
            if switch["on"]:
                return wrapper(wrapped, instance, args, kwargs)
            return wrapped(*args, **kwargs)

        installed = wrapper_type()(current, call)
        self._undo.append(AttributeChange(target, owner, name, current, installed, switch))
        setattr(owner, name, installed)
        return current

    def changes(self):
        return [change.describe() for change in self._undo]

    def targets_changed(self):
        """The targets this transaction changed ("module:qualname"); one may be both rebuilt and wrapped."""
        return {repr(change.target) for change in self._undo}

    def blocked(self):
        """Changes that cannot be undone now (another tool swapped a function's code since)."""
        return [why for why in (change.blocked() for change in self._undo) if why]

    def intact(self):
        """Whether every change is still in force where the target's module now points (False after a
        reload, which re-creates the module's classes and functions)."""
        try:
            return all(change.intact(self) for change in self._undo)
        except Exception:
            return False

    def rollback(self):
        """Undo every change, last first. Always whole: see CodeChange.undo and AttributeChange.undo."""
        while self._undo:
            self._undo.pop().undo()
