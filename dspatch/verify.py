"""Run a patch's reproducers in this process and report what each one saw.

    python -m dspatch.verify deepspeed/zero3-module-id [--apply] [--only NAME]

Prints one JSON object: {"applied": [...], "results": {scenario: "ok" | "bug: ..." | "error: ..."}}.
Without --apply the process runs whatever the environment gives it (stock code, DSPATCH via dspatch.pth,
or an upstream diff applied to a copy on PYTHONPATH); with --apply it calls dspatch.apply(id) first.
"""
import argparse
import json
import sys
import traceback


def run_scenarios(patch, only=None):
    from dspatch.spec import BugSeen

    results = {}
    for name, scenario in patch.scenarios.items():
        if only and name not in only:
            continue
        try:
            scenario()
            results[name] = "ok"
        except BugSeen as e:
            results[name] = f"bug: {e}"
        except Exception as e:  # an unexpected failure is neither "fixed" nor "reproduced"
            results[name] = f"error: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dspatch.verify", description=__doc__.splitlines()[0])
    parser.add_argument("patch_id")
    parser.add_argument("--apply", action="store_true", help="dspatch.apply(patch_id) before the scenarios")
    parser.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    args = parser.parse_args(argv)

    import dspatch
    from dspatch import _runtime, registry

    patch = registry.all_patches().get(args.patch_id)
    if patch is None:
        parser.error(f"unknown patch id {args.patch_id!r}; known ids: {', '.join(registry.all_patches())}")
    if args.apply:
        dspatch.apply([args.patch_id], strict=True)
    results = run_scenarios(patch, args.only)
    print(json.dumps({"applied": _runtime.applied_ids(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
