"""dspatch's command line.

    python -m dspatch.apply --check [--json] [--strict] [--verify]   what applies here, and why
    python -m dspatch.apply [--only IDS] script.py [args...]         run a script with dspatch active

`--check` decides from installed metadata and source files; it imports neither torch nor any patched
package (except with --verify, which runs each applicable patch's reproducers in subprocesses).
"""
import os
import sys

import dspatch
from dspatch import gating, registry, status as report

PROBLEMS = (gating.DRIFTED, gating.FAILED, gating.BROKEN)


def _env_summary(environ):
    shown = {k: registry.short(environ[k]) for k in ("DSPATCH", "DSPATCH_DISABLE", "DSPATCH_STRICT")
             if environ.get(k)}
    if not registry.flag("DSPATCH", environ):
        state = "DSPATCH is not set: nothing is applied until you set DSPATCH=1 (or a list of ids)"
    else:
        state = "active: patches marked 'applies' are applied when their package is imported"
    return shown, state


def _verify(patch, progress=None):
    """Run the reproducers on stock code and with the patch, each in a fresh interpreter."""
    import time

    outcome = {}
    for mode, extra in (("stock", []), ("patched", ["--apply"])):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSPATCH")}
        env["DS_ACCELERATOR"] = "cpu"  # the reproducers build CPU tensors
        started = time.monotonic()
        if progress:
            progress(f"dspatch: --verify {patch.id}: {mode} ({len(patch.scenarios)} reproducers)...")
        import json
        import subprocess  # --verify only: --check stays light

        proc = subprocess.run([sys.executable, "-m", "dspatch.verify", patch.id, *extra], env=env,
                              capture_output=True, text=True)
        if progress:
            progress(f"dspatch: --verify {patch.id}: {mode} done in {time.monotonic() - started:.0f} s")
        try:
            outcome[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
        except (IndexError, ValueError, KeyError):
            outcome[mode] = {"run": f"error: exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    stock, patched = outcome["stock"], outcome["patched"]
    reproduced = [n for n, fragment in patch.expected_on_stock.items()
                  if stock.get(n, "").startswith("bug:") and fragment in stock[n]]
    fixed = [n for n, r in patched.items() if r == "ok"]
    ok = len(fixed) == len(patched) and bool(patched)
    summary = (f"stock reproduces {len(reproduced)}/{len(patch.expected_on_stock)}, "
               f"patched passes {len(fixed)}/{len(patched)}")
    return ok, summary, outcome


def check(args):
    try:
        rows = report.check_all(args.only, source=_only_source(args))
    except registry.SelectionError as e:
        print(f"dspatch: {e}", file=sys.stderr)
        return 2
    shown, state = _env_summary(os.environ)
    status = 1 if args.strict and any(r.verdict in PROBLEMS for r in rows) else 0
    verified = {}
    if args.verify:
        for row in rows:
            if row.verdict in (gating.APPLIES, gating.APPLIED):
                ok, summary, outcome = _verify(row.patch, progress=lambda m: print(m, file=sys.stderr, flush=True))
                verified[row.patch.id] = {"ok": ok, "summary": summary, "scenarios": outcome}
                status = status or (0 if ok else 1)
    if args.json:
        out = {"dspatch": dspatch.__version__, "environment": shown, "state": state, "patches": []}
        for row in rows:
            d = row.as_dict()
            if row.patch.id in verified:
                d["verify"] = verified[row.patch.id]
            out["patches"].append(d)
        import json

        print(json.dumps(out, indent=2))
        return status
    print(f"dspatch {dspatch.__version__}: {state}")
    if shown:
        print("  " + " ".join(f"{k}={v}" for k, v in shown.items()))
    if args.verify:
        print("  --verify runs each reproducer in a fresh interpreter on the CPU (DS_ACCELERATOR=cpu, gloo), "
              "whatever accelerator this machine has")
    table = [("patch", "package", "verdict", "why")]
    table += [(row.patch.id, f"{row.patch.distribution}=={row.version}" if row.version else row.patch.distribution,
               row.verdict, report.brief(row)) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(3)]
    for number, line in enumerate(table):
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[3])
        if number == 0:
            print("  ".join("-" * width for width in widths) + "  " + "-" * 3)
            continue
        row = rows[number - 1]
        if args.verbose:
            print(f"    {row.patch.summary}")
            print(f"    why: {row.reason}")
            if row.patch.note and row.verdict in (gating.APPLIES, gating.APPLIED):
                print(f"    note: {row.patch.note}")
            for link in row.patch.links:
                print(f"    see: {link}")
        if row.patch.id in verified:
            v = verified[row.patch.id]
            print(f"    verify: {'OK' if v['ok'] else 'FAILED'} ({v['summary']})")
            stock, patched = v["scenarios"]["stock"], v["scenarios"]["patched"]
            for name in dict.fromkeys([*stock, *patched]):  # what each reproducer saw, in the bug's own words
                seen = stock.get(name, "not run").split("\n")[0]
                print(f"    {name}: stock: {seen[:160]}; patched: {patched.get(name, 'not run').split(chr(10))[0][:160]}")
    if not args.verbose:
        print("(-v: each patch's summary, full reason, notes and links; --json: everything)")
    return status


def _only_source(args):
    return f"--only {registry.short(','.join(args.only or []))}"


def run_script(args):
    # Through the environment, so that every process the script starts (spawn workers, launchers) is
    # patched the same way, as with DSPATCH=... on the command line.
    try:  # a bad selection is refused before the script runs (it would run unpatched)
        registry.selection(args.only, source=_only_source(args))
    except registry.SelectionError as e:
        print(f"dspatch: {e}; {args.script} not run", file=sys.stderr)
        return 2
    if args.only is not None:
        os.environ["DSPATCH"] = ",".join(args.only)
    elif not registry.flag("DSPATCH"):
        os.environ["DSPATCH"] = "1"
    dspatch.apply(None, strict=None)
    sys.argv = [args.script, *args.script_args]
    import runpy

    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")
    return 0


# `--check` with these flags alone (what users and launchers run) is read without argparse, which with the
# shutil it pulls in costs a sixth of --check; anything else (a script, --only, --help, a typo) goes to argparse
_PLAIN_FLAGS = {"--check": "check", "--json": "json", "-v": "verbose", "--verbose": "verbose", "--strict": "strict",
                "--verify": "verify"}


def _plain(argv):
    """The parsed arguments when argv holds only flags of _PLAIN_FLAGS, each once; else None."""
    if len(set(argv)) != len(argv) or not set(argv) <= set(_PLAIN_FLAGS):
        return None
    if "-v" in argv and "--verbose" in argv:
        return None
    import types

    args = types.SimpleNamespace(**dict.fromkeys(_PLAIN_FLAGS.values(), False), only=None, script=None,
                                 script_args=[])
    for flag in argv:
        setattr(args, _PLAIN_FLAGS[flag], True)
    return args


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dspatch.apply", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--check", action="store_true", help="show every patch's verdict here, and why")
    parser.add_argument("--json", action="store_true", help="with --check: machine-readable output")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="with --check: each patch's summary, full reason, notes and links")
    parser.add_argument("--strict", action="store_true", help="with --check: exit 1 if a patch drifted or failed")
    parser.add_argument("--verify", action="store_true",
                        help="with --check: run each applicable patch's reproducers, stock and patched")
    parser.add_argument("--only", type=registry.split, default=None, metavar="IDS",
                        help="comma-separated patch ids or prefixes instead of DSPATCH")
    parser.add_argument("script", nargs="?", help="a Python script to run with dspatch active")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def main(argv=None):
    args = _plain(sys.argv[1:] if argv is None else list(argv))
    if args is not None:
        return check(args)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.script and args.check:
        parser.error("--check takes no script: run `--check` alone, or a script without it")
    if args.script and not os.path.isfile(args.script):
        print(f"dspatch: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.script:
        return run_script(args)
    return check(args)  # `--check` is the default: `dspatch` alone shows the verdicts


def _main():
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `--check | head`: end quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    _main()
