"""What --check shows: each patch's verdict for this environment (dspatch.gating, which knows nothing of this
process) joined with the selection (dspatch.registry) and what this process has done (dspatch._runtime)."""
import os
import sys

from dspatch import gating, registry


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
    runtime = sys.modules.get("dspatch._runtime")  # not loaded: this process has applied nothing
    for pid, patch in patches.items():
        version, verdict, reason = gating.evaluate(patch)
        state = runtime.state_of(pid) if runtime else None
        if state is not None:
            verdict, reason = state
        elif pid in left_out:
            reason = f"{left_out[pid]} ({verdict}: {reason})"
            verdict = gating.DISABLED
        rows.append(gating.Row(patch, version, verdict, reason))
    return rows


def brief(row, limit=72):
    """A few words of why, for the one-line row of `--check` (the whole reason is in -v and --json)."""
    patch, verdict, reason = row.patch, row.verdict, row.reason
    if verdict == gating.APPLIES:
        needs = [part.split(" (the bug needs")[0] for part in reason.split(", with ")[1:]]
        where = "open upstream" if not patch.fixed_in else f"{patch.distribution}{patch.affected}"
        return ", ".join([f"has the bug ({where})", *[f"with {n}" for n in needs]])
    if verdict == gating.APPLIED:
        return "applied in this process"
    if verdict == gating.FIXED_UPSTREAM and reason.startswith("fixed upstream in"):
        return f"fixed in {patch.fixed_in}"
    if verdict == gating.NOT_AFFECTED and reason.startswith("the bug needs"):
        need, _, seen = reason[len("the bug needs "):].partition("; ")
        other = need.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0]
        return f"needs {need} ({seen[len(other) + 1:].replace(' is installed', '') or 'none'} here)"
    if verdict == gating.NOT_AFFECTED:
        return f"the bug is in {patch.affected} only"
    if verdict == gating.UNSUPPORTED:
        return f"written for {patch.supported} only"
    if verdict == gating.DISABLED:
        return reason.split(" (")[0]
    if verdict == gating.NOT_INSTALLED:
        return ""
    if verdict == gating.BROKEN:
        return "files there, but its metadata (dist-info) is missing or unreadable"
    text = reason.split("; ")[0] if verdict == gating.DRIFTED else reason
    return text if len(text) <= limit else text[:limit - 3] + "..."
