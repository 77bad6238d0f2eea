"""Run a patch's reproducers in this process and report what each one saw.

    python -m dspatch.verify deepspeed/zero3-module-id [--apply] [--only NAME]
    python -m dspatch.verify deepspeed/zero3-module-id --leave-out-each

Prints one JSON object: {"applied": [...], "results": {scenario: "ok" | "bug: ..." | "error: ..."},
"files": {target module: its file}}.
Without --apply the process runs whatever the environment gives it (stock code, DSPATCH via dspatch.pth,
or an upstream diff applied to a copy on PYTHONPATH); with --apply it calls dspatch.apply(id) first.

--leave-out-each is the proof that every target is necessary: for each target in turn, the patch is
applied without it, the scenarios run until one fails, and the patch is reverted. Prints {"left_out": {target: results}}.
"""
import argparse
import json
import sys
import traceback


def run_scenarios(patch, only=None, until_failure=False):
    from dspatch.scenario import settle
    from dspatch.spec import BugSeen

    results = {}
    for name, scenario in patch.scenarios.items():
        if only and name not in only:
            continue
        if until_failure and any(r != "ok" for r in results.values()):
            break
        settle()  # the previous scenario's garbage collected, the stack out of the collector's sight
        try:
            scenario()
            results[name] = "ok"
        except BugSeen as e:
            results[name] = f"bug: {e}"
            # the whole traceback, upstream's own exception included: what a user's log shows
            # (dspatch.explain is tested on these)
            print(f"dspatch.verify: {name}: the bug shows", file=sys.stderr)
            traceback.print_exception(e, file=sys.stderr)
        except Exception as e:  # an unexpected failure is neither "fixed" nor "reproduced"
            results[name] = f"error: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    return results


def leave_out_each(patch):
    """{qualname: scenario results} with the patch applied except that one target, each in turn."""
    import dspatch
    from dspatch import _runtime

    import importlib

    for module in patch.modules:  # applied now, not when a scenario imports them
        importlib.import_module(module)
    results = {}
    real = {name: getattr(_runtime.Transaction, name) for name in ("recode", "wrap")}
    # every scenario builds its own objects and drops them: those of one round never meet the next
    in_use, patch.in_use = patch.in_use, None
    try:
        for target in patch.targets:
            for name, method in real.items():
                def skipping(self, t, *args, _method=method, **kwargs):
                    return None if t.qualname == target.qualname else _method(self, t, *args, **kwargs)

                setattr(_runtime.Transaction, name, skipping)
            outcome = dspatch.apply([patch.id], strict=True)[patch.id]
            if outcome[0] != "applied":
                results[target.qualname] = {"apply": f"error: {outcome}"}
                continue
            # one failing reproducer proves the target necessary: the rest need not run (and jobs they launch
            # leave the patch out: scenario.rank_environment)
            patch.left_out = target.qualname
            results[target.qualname] = run_scenarios(patch, until_failure=True)
            patch.left_out = None
            dspatch.revert([patch.id], force=True)
    finally:
        for name, method in real.items():
            setattr(_runtime.Transaction, name, method)
        patch.in_use = in_use
        patch.left_out = None
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dspatch.verify", description=__doc__.splitlines()[0])
    parser.add_argument("patch_id")
    parser.add_argument("--apply", action="store_true", help="dspatch.apply(patch_id) before the scenarios")
    parser.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    parser.add_argument("--leave-out-each", action="store_true",
                        help="apply the patch without each target in turn and run the scenarios (the proof "
                             "that every target is necessary)")
    args = parser.parse_args(argv)

    import dspatch
    from dspatch import _runtime, registry
    from dspatch.scenario import leave_distributed

    patch = registry.all_patches().get(args.patch_id)
    if patch is None:
        guess = registry.closest(args.patch_id)
        parser.error(f"unknown patch id {registry.short(args.patch_id)}"
                     f"{f' (did you mean {guess}?)' if guess else ''}; `dspatch check` lists the ids")
    if args.leave_out_each:
        print(json.dumps({"left_out": leave_out_each(patch)}), flush=True)
        leave_distributed()
        return 0
    if args.apply:
        dspatch.apply([args.patch_id], strict=True)
    import importlib

    for module in patch.modules:  # imported here, so that this process runs (and a job it launches gets) the patch
        try:                     # as the environment gives it even when the scenarios themselves run elsewhere
            importlib.import_module(module)
        except ImportError:
            pass
    results = run_scenarios(patch, args.only)
    # which files the targets ran from: a copy of upstream on PYTHONPATH, or the installed package
    files = {m: getattr(sys.modules.get(m), "__file__", None) for m in patch.modules}
    print(json.dumps({"applied": _runtime.applied_ids(), "results": results, "files": files}), flush=True)
    leave_distributed()  # whichever code made the process group (DeepSpeed, accelerate, the Trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
