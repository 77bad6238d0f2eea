"""Applies patches in this process: each one whole or not at all, once, revertibly.

Loaded on the first import of a watched package (or by dspatch.apply()); imports wrapt only when a patch
actually applies.
"""
import os
import sys
import threading

from dspatch import gating, registry

_lock = threading.RLock()
_active = False
_strict = False
_pending = {}    # id -> Patch selected, waiting for its target modules to finish importing
_applied = {}    # id -> Transaction
_superseded = {}  # id -> [Transaction]: still in force on class objects a reload replaced (others hold them)
_outcome = {}    # id -> (verdict, reason) decided in this process
_reported = set()
_strict_failures = {}  # id -> message: under DSPATCH_STRICT=1 every later import of its modules fails too


class PatchError(RuntimeError):
    """A patch could not apply and DSPATCH_STRICT=1 asked for that to be an error."""


def _say(message):
    # Quiet by default: local rank 0 only (one line per node), every rank with DSPATCH_VERBOSE=1.
    if os.environ.get("LOCAL_RANK", "0") in ("", "0") or registry.flag("DSPATCH_VERBOSE"):
        print(f"dspatch: {message}", file=sys.stderr, flush=True)


def _report(key, message):
    if key not in _reported:
        _reported.add(key)
        _say(message)


def state_of(pid):
    return _outcome.get(pid)


def applied_ids():
    return list(_applied)


def _module_ready(name, just_loaded=None):
    # The module the hook just reported has executed but is still flagged as initialising until the
    # import system finishes with it; any other module counts once it is fully imported (now, not ever).
    if name == just_loaded:
        return True
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def module_loaded(name):
    """Called by the import hook after a module of a watched package has executed."""
    with _lock:
        if not _active:
            activate(None, None, just_loaded=name)
        else:
            _requeue_if_reloaded(name)
            _apply_ready(name)
        if name == LAUNCHER:
            forward_to_nodes()
        if _strict:
            for pid, message in _strict_failures.items():
                if name in registry.all_patches()[pid].modules:
                    raise PatchError(message)


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
    global _active, _strict
    with _lock:
        _strict = registry.flag("DSPATCH_STRICT") if strict is None else bool(strict)
        _active = True
        try:
            chosen, _ = registry.selection(ids)
        except registry.SelectionError as e:
            _report(("selection", str(e)), f"{e}. Nothing applied.")
            if _strict:
                raise
            return {}
        from dspatch import _boot

        if _boot.finder() is None:
            sys.meta_path.insert(0, _boot.PostImportFinder(_boot._notify))
        patches = registry.all_patches()
        for pid in chosen:
            if pid not in _applied:
                _outcome.pop(pid, None)
                _pending[pid] = patches[pid]
        _apply_ready(None, late=just_loaded is None, just_loaded=just_loaded)
        if _module_ready(LAUNCHER, just_loaded):
            forward_to_nodes()
        return {pid: _outcome.get(pid, ("pending", f"waiting for {', '.join(patches[pid].modules)}"))
                for pid in chosen}


def _requeue_if_reloaded(name):
    # A reload (or a fresh import after sys.modules was purged) re-executes a module: its classes are new,
    # unpatched objects, while other modules still hold the old ones. Keep the old ones patched (so
    # nothing mixes the two numberings) and patch the new ones too.
    for pid, txn in list(_applied.items()):
        if name in txn.patch.modules and not txn.intact():
            _superseded.setdefault(pid, []).append(txn)
            del _applied[pid]
            _outcome.pop(pid, None)
            _pending[pid] = txn.patch


def _apply_ready(trigger, late=False, just_loaded=None):
    """Apply pending patches whose modules have all finished importing. `late`: they finished before
    activation, so upstream objects may already be in use."""
    just_loaded = just_loaded or trigger
    for pid, patch in list(_pending.items()):
        if trigger is not None and trigger not in patch.modules:
            continue
        if all(_module_ready(m, just_loaded) for m in patch.modules):
            del _pending[pid]
            _apply_one(patch, late)


def _fail(patch, verdict, reason, message, cause=None):
    _outcome[patch.id] = (verdict, reason)
    _report(patch.id, message)
    if _strict:
        _strict_failures[patch.id] = f"dspatch: {patch.id}: {reason} (DSPATCH_STRICT=1)"
        raise PatchError(_strict_failures[patch.id]) from cause


def _apply_one(patch, late=False):
    version, verdict, reason = gating.evaluate(patch)
    if verdict == gating.DRIFTED:
        return _fail(patch, verdict, reason, f"{patch.id} skipped: {reason}")
    if verdict != gating.APPLIES:
        _outcome[patch.id] = (verdict, reason)
        return
    busy = patch.in_use() if late and patch.in_use else None
    if busy:
        reason = f"not applied: {busy}"
        return _fail(patch, gating.FAILED, reason, f"{patch.id} {reason}")
    txn = Transaction(patch)
    try:
        patch.apply(txn)
    except Exception as e:
        txn.rollback()
        reason = f"{type(e).__name__}: {e}; left out whole, nothing changed"
        return _fail(patch, gating.FAILED, reason,
                     f"{patch.id} could not apply to {patch.distribution} {version}: {reason}", e)
    _applied[patch.id] = txn
    _strict_failures.pop(patch.id, None)
    _outcome[patch.id] = (gating.APPLIED, f"applied in this process to {patch.distribution} {version}")
    _say(f"applied {patch.id} ({patch.distribution} {version})")


def revert(ids=None, force=False):
    """Undo applied patches; with no ids, also stop watching imports. A patch whose `in_use()` says live
    objects depend on it is not reverted (RuntimeError) unless `force`."""
    global _active
    with _lock:
        wanted = list(_applied) if ids is None else registry._resolve_tokens(
            registry.split(ids) if isinstance(ids, str) else list(ids), "dspatch.revert()")
        busy = {pid: _applied[pid].patch.in_use() for pid in wanted
                 if pid in _applied and _applied[pid].patch.in_use and not force}
        busy = {pid: why for pid, why in busy.items() if why}
        if busy:
            raise RuntimeError("dspatch: not reverted, " + "; ".join(f"{p}: {w}" for p, w in busy.items())
                               + " (revert(force=True) if they will not be used again)")
        done = []
        for pid in wanted:
            _pending.pop(pid, None)
            _strict_failures.pop(pid, None)
            txn = _applied.pop(pid, None)
            if txn is not None:
                txn.rollback()
                done.append(pid)
            for old in reversed(_superseded.pop(pid, [])):
                old.rollback()
            _outcome.pop(pid, None)
        if ids is None:
            from dspatch import _boot

            _pending.clear()
            _boot.uninstall()
            _active = False
        return done


class Transaction:
    """The changes one patch makes, recorded so that they can be undone together."""

    def __init__(self, patch):
        self.patch = patch
        self._undo = []  # (target, owner, attribute, original, installed wrapper)

    def target(self, qualname):
        for t in self.patch.targets:
            if t.qualname == qualname:
                return t
        raise KeyError(qualname)

    def resolve(self, target):
        """(owner, attribute name, raw original) of a target in its imported module; where an earlier
        transaction of this patch still sits (after a reload elsewhere), upstream's original behind it."""
        owner = sys.modules[target.module]
        *path, name = target.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = vars(owner)[name]
        for old in _superseded.get(self.patch.id, ()):
            for _, old_owner, old_name, original, installed in old._undo:
                if installed is raw:
                    return owner, name, original
        return owner, name, raw

    def wrap(self, target, wrapper):
        """Install wrapt.FunctionWrapper(original, wrapper) on the target; returns the original."""
        import wrapt

        owner, name, original = self.resolve(target)
        return self._install(target, owner, name, original, wrapt.FunctionWrapper(original, wrapper))

    def replace(self, target, rebuilt):
        """Install a function rebuilt from the target's own source (dspatch.rewrite) in its place. No wrapper:
        on a hot path the copy costs exactly what upstream's function costs. Marked `__dspatch__`."""
        owner, name, original = self.resolve(target)
        rebuilt.__dspatch__ = self.patch.id
        return self._install(target, owner, name, original, rebuilt)

    def _install(self, target, owner, name, original, installed):
        setattr(owner, name, installed)
        self._undo.append((target, owner, name, original, installed))
        return original

    def originals(self):
        """{qualname: (original, installed)} of what this transaction changed."""
        return {target.qualname: (original, installed) for target, _, _, original, installed in self._undo}

    def intact(self):
        """Whether every wrapper is still where it was installed (False after a reload)."""
        try:
            return all(self.resolve(target)[2] is installed for target, _, _, _, installed in self._undo)
        except (KeyError, AttributeError):
            return False

    def rollback(self):
        """Restore every original whose wrapper is still in place (never undo someone else's change)."""
        while self._undo:
            _, owner, name, original, installed = self._undo.pop()
            if vars(owner).get(name) is installed:
                setattr(owner, name, original)
