"""What --check shows: each patch's verdict for this environment (dspatch.gating, which knows nothing of this
process) joined with the selection (dspatch.registry) and what this process has done (dspatch._runtime)."""
import os
import sys

from dspatch import gating, registry


def check_all(ids=None, environ=None, source="dspatch.apply()", refused=False):
    """Rows for every registered patch: environment verdict, then selection, then in-process state.

    A malformed selection raises SelectionError; with `refused`, it is reported instead, as the runtime acts on it:
    every patch left out, the message as the reason (nothing is applied while it stands)."""
    patches = registry.all_patches()
    env = os.environ if environ is None else environ
    active = ids is not None or registry.active(env)
    left_out = {}
    if active:
        try:
            _, left_out = registry.selection(ids, env, source)
        except registry.SelectionError as e:
            if not refused:
                raise
            left_out = dict.fromkeys(patches, f"{e}: nothing is applied")
    rows = []
    runtime = sys.modules.get("dspatch._runtime")  # not loaded: this process has applied nothing
    for pid, patch in patches.items():
        found = gating.evaluate(patch)
        state = runtime.state_of(pid) if runtime else None
        if state is not None:
            rows.append(gating.Row(patch, found, *state))
        elif pid in left_out:
            rows.append(gating.Row(patch, found, gating.DISABLED, f"{left_out[pid]} ({found.verdict}: {found.reason})",
                                   disabled_by=left_out[pid]))
        else:
            rows.append(gating.Row(patch, found))
    return rows


def brief(row, limit=72):
    """A few words of why, for the one-line row of `--check` (the whole reason is in -v and --json), read from
    the verdict's fields."""
    patch, verdict, found = row.patch, row.verdict, row.found
    if verdict == gating.APPLIES:
        where = f"fixed upstream in {patch.fixed_in}" if patch.fixed_in else "open upstream"
        return ", ".join([where, *[f"with {other} {seen}" for other, seen in found.seen.items()]])
    if verdict == gating.APPLIED:
        return "applied in this process"
    if verdict == gating.FIXED_UPSTREAM and found.rule == "release":
        return f"fixed in {found.bound}"
    if verdict == gating.NOT_AFFECTED and found.rule == "requires":
        (seen,) = found.seen.values()
        return f"needs {found.bound} ({seen or 'none'} here)"
    if verdict == gating.NOT_AFFECTED:
        return f"the bug is in {patch.affected}"
    if verdict == gating.UNSUPPORTED:
        return f"written for {patch.supported} only"
    if verdict == gating.DISABLED:
        return row.disabled_by
    if verdict == gating.NOT_INSTALLED:
        return ""
    if verdict == gating.BROKEN:
        return "files there, but its metadata (dist-info) is missing or unreadable"
    text = found.mismatch if verdict == gating.DRIFTED and found.mismatch else row.reason
    return text if len(text) <= limit else text[:limit - 3] + "..."
