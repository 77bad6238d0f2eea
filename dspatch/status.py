"""What --check shows: each patch's verdict for this environment (dspatch.gating, which knows nothing of this
process) joined with the selection (dspatch.registry) and what this process has done (dspatch._runtime)."""
import os

from dspatch import _runtime, gating, registry  # _runtime is light: it imports wrapt only to apply a patch


def check_all(ids=None, environ=None, source="dspatch.apply()"):
    """Rows for every registered patch: environment verdict, then selection, then in-process state."""
    patches = registry.all_patches()
    env = os.environ if environ is None else environ
    active = ids is not None or registry.flag("DSPATCH", env)
    if active:
        _, left_out = registry.selection(ids, env, source)
    else:
        left_out = {}
    rows = []
    for pid, patch in patches.items():
        version, verdict, reason = gating.evaluate(patch)
        state = _runtime.state_of(pid)
        if state is not None:
            verdict, reason = state
        elif pid in left_out:
            reason = f"{left_out[pid]} ({verdict}: {reason})"
            verdict = gating.DISABLED
        rows.append(gating.Row(patch, version, verdict, reason))
    return rows
