"""dspatch's command line: `dspatch COMMAND` (the console script), as pip and git have it.

    dspatch check [--json] [-v] [--strict] [--only IDS]   what applies here, and why (`dspatch` alone too)
    dspatch verify [--only IDS] [--json]                  run the reproducers of what applies: stock, then patched
    dspatch explain LOG [--json]                          which known bug a failed job's log shows, and what to do
    dspatch export --out DIR [--all]                      the upstream diffs for the installed releases (`git am`)
    dspatch run [--only IDS] script.py [args...]          run a script with dspatch active (DSPATCH=1 unless set)
    dspatch audit FILE... [--pins PINS] [--json]          the known bugs a lock or requirements file's pins have

`check` decides from installed metadata and source files; it imports neither torch nor any patched package
(`verify` runs each applicable patch's reproducers in subprocesses). `python -m dspatch.apply --check`,
`python -m dspatch.explain`, `python -m dspatch.export` keep working.
"""
import os
import sys

import dspatch
from dspatch import _apply as dspatch_apply, gating, registry, status as report

PROBLEMS = (gating.DRIFTED, gating.FAILED, gating.BROKEN)


def _env_summary(environ):
    shown = {k: registry.short(environ[k]) for k in ("DSPATCH", "DSPATCH_DISABLE", "DSPATCH_STRICT")
             if environ.get(k)}
    if not registry.active(environ):
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
    unpatched = _known_here()
    if args.json:
        out = {"dspatch": dspatch.__version__, "environment": shown, "state": state, "patches": []}
        for row in rows:
            d = row.as_dict()
            if row.patch.id in verified:
                d["verify"] = verified[row.patch.id]
            out["patches"].append(d)
        out["unpatched"] = [{"id": k.id, "distribution": k.distribution, "version": v, "effect": k.effect,
                             "affected": k.affected, "fixed_in": k.fixed_in, "advice": k.advice,
                             "links": list(k.links)} for k, v in unpatched]
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
    if unpatched:
        print(f"\nKnown bugs of these releases that dspatch does not patch ({len(unpatched)}):")
        for known, version in unpatched:
            fix = f"fixed in {known.fixed_in}" if known.fixed_in else "open upstream"
            print(f"  {known.id} ({known.distribution}=={version}): {known.effect}; {fix}; meanwhile: {known.advice}")
    if not args.verbose:
        print("(-v: each patch's summary, full reason, notes and links; --json: everything)")
    return status


def _known_here():
    """[(Known, installed version)] of the known bugs no patch fixes that the installed releases have."""
    from dspatch.known import KNOWN, present

    names = {n for k in KNOWN for n in (k.distribution, *k.requires)}
    installed = {n: gating.installed_version(n) for n in names}
    return [(k, installed[k.distribution]) for k in present(installed)]


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
    elif not registry.active():
        os.environ["DSPATCH"] = "1"
    dspatch_apply(None, strict=None)
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


def _parser(prog="python -m dspatch.apply"):
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description="what applies here and why (--check), or run a script "
                                     "with dspatch active", formatter_class=argparse.RawDescriptionHelpFormatter)
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


def legacy_main(argv=None, prog="python -m dspatch.apply"):
    """`python -m dspatch.apply` (flags, or a script): what `dspatch check` and `dspatch run` do now."""
    args = _plain(sys.argv[1:] if argv is None else list(argv))
    if args is not None:
        return check(args)
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.script and args.check:
        parser.error("--check takes no script: run `--check` alone, or a script without it")
    if args.script and not os.path.isfile(args.script):
        print(f"dspatch: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.script:
        return run_script(args)
    return check(args)  # `--check` is the default: `dspatch` alone shows the verdicts


COMMANDS = {"check": "what applies here, and why", "verify": "run the reproducers of what applies, stock then patched",
            "explain": "which known bug a failed job's log shows", "export": "the upstream diffs for this environment",
            "run": "run a script with dspatch active",
            "audit": "the known bugs a lock or requirements file's pins have, before installing"}


def _usage():
    lines = ["usage: dspatch COMMAND [options]   (dspatch COMMAND --help for each)", "", "commands:"]
    lines += [f"  {name:<9} {what}" for name, what in COMMANDS.items()]
    lines += ["", "`dspatch` alone is `dspatch check`. Patching a job: DSPATCH=1 in its environment (every rank), or",
              "`dspatch run train.py`. Docs: the README and docs/ of the source tree."]
    return "\n".join(lines)


def main(argv=None):
    """The `dspatch` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command, rest = (argv[0], argv[1:]) if argv else ("check", [])
    if command in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if command == "check":
        if "-h" in rest or "--help" in rest:
            print("usage: dspatch check [--json] [-v] [--strict] [--only IDS]\n\n" + COMMANDS["check"] +
                  ": one row per patch (package==version, verdict, why); --json for tools, -v for every reason, "
                  "--strict exits 1 when a patch drifted or failed")
            return 0
        return legacy_main(["--check", *rest], prog="dspatch check")
    if command == "verify":
        if "-h" in rest or "--help" in rest:
            print("usage: dspatch verify [--only IDS] [--json] [-v]\n\n" + COMMANDS["verify"] + ", each in a fresh "
                  "interpreter on the CPU (DS_ACCELERATOR=cpu, gloo); exits 1 when one does not behave as declared")
            return 0
        return legacy_main(["--check", "--verify", *rest], prog="dspatch verify")
    if command == "explain":
        from dspatch import explain

        return explain.main(rest, prog="dspatch explain")
    if command == "export":
        from dspatch import export

        return export.main(rest, prog="dspatch export")
    if command == "audit":
        from dspatch import audit

        return audit.main(rest, prog="dspatch audit")
    if command == "run":
        if not rest or rest[0] in ("-h", "--help"):
            print("usage: dspatch run [--only IDS] script.py [args...]\n\n" + COMMANDS["run"] + " (DSPATCH=1 unless "
                  "DSPATCH or --only selects patches); the processes it starts are patched the same way")
            return 0 if rest else 2
        return legacy_main(rest, prog="dspatch run")
    if command.startswith("-") or os.path.isfile(command):  # the first releases' forms: `dspatch --check`, a script
        return legacy_main(argv, prog="dspatch")
    print(f"dspatch: {command!r} is not a command (nor a script here)\n\n{_usage()}", file=sys.stderr)
    return 2


def _exit(call):
    try:
        code = call()
        sys.stdout.flush()
    except BrokenPipeError:  # `dspatch check | head`: end quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except KeyboardInterrupt:
        print("dspatch: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


def run_legacy():
    _exit(legacy_main)


def run():
    """The console script's entry point."""
    _exit(main)


if __name__ == "__main__":
    run()
