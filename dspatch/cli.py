"""dspatch's command line: `dspatch COMMAND` (the console script; `python -m dspatch` too), as pip and git have it.

    dspatch check [ID...] [--json] [-v] [--strict]    what applies here, and why (`dspatch` alone too)
    dspatch verify [ID...] [--device D] [--json]      run the reproducers of what applies: stock, then patched
    dspatch explain LOG [--json]                      which known bug a failed job's log shows, and what to do
    dspatch export --out DIR [--all]                  the upstream diffs for the installed releases (`git am`)
    dspatch run [--only IDS] SCRIPT [ARGS...]         a script (or -m MODULE) with dspatch active
    dspatch audit FILE... [--pins PINS] [--json]      the known bugs a lock or requirements file's pins have
    dspatch canary CONFIG [--loop L] [--stock]        your DeepSpeed config against plain torch, step by step

`check` decides from installed metadata and source files; it imports neither torch nor any patched package.
`python -m dspatch.apply --check` (the first releases' form) keeps working: dspatch/legacy.py.

Exit codes, every command: 0 done, 1 what was asked found a problem (a drifted patch with --strict, a reproducer
that did not behave as declared, a bug in the pins with --strict), 2 bad input (usage, a malformed DSPATCH, an
unknown id, an unreadable file), 5 nothing to do (as pytest's "no tests ran": verify with nothing that applies).
"""
import os
import sys

import dspatch
from dspatch import gating, registry, term

from dspatch.asked import BadInput, asked_rows, selection_or_bad_input, say
from dspatch.check_view import PROBLEMS, print_lines, check, check_json, check_text

__all__ = ["BadInput", "NOTHING_RAN", "PROBLEMS", "check", "check_json", "check_text", "main", "run", "say",
           "verify"]

NOTHING_RAN = 5


# ---- verify ------------------------------------------------------------------------------------------------------

def device(choice, environ=None):
    """(DS_ACCELERATOR value, what to say of it) for `verify --device choice`: auto takes DS_ACCELERATOR when set,
    else the accelerator torch sees (CUDA), else the CPU."""
    env = os.environ if environ is None else environ
    if choice != "auto":
        return choice, f"{choice} (--device {choice})"
    if env.get("DS_ACCELERATOR"):
        return env["DS_ACCELERATOR"], f"{env['DS_ACCELERATOR']} (DS_ACCELERATOR is set)"
    import subprocess

    probe = subprocess.run([sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()), "
                            "torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"],
                           capture_output=True, text=True, env={**env, "DSPATCH": ""})
    seen, _, name = probe.stdout.strip().partition(" ")
    if seen == "1":
        return "cuda", f"cuda ({name or 'a CUDA device'}; nccl): --device cpu for the CPU"
    return "cpu", "cpu (gloo): no CUDA device seen by torch"


def _verify(patch, accelerator="cpu", progress=None, label=""):
    """Run the reproducers on stock code and with the patch, each in a fresh interpreter."""
    import json
    import subprocess
    import time

    outcome = {}
    for mode, extra in (("stock", []), ("patched", ["--apply"])):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSPATCH")}
        env["DS_ACCELERATOR"] = accelerator
        started = time.monotonic()
        if progress:
            progress(f"{label}{patch.id}: {mode} ({len(patch.scenarios)} reproducers)...")
        proc = subprocess.run([sys.executable, "-m", "dspatch.verify", patch.id, *extra], env=env,
                              capture_output=True, text=True)
        if progress:
            progress(f"{label}{patch.id}: {mode} done in {time.monotonic() - started:.0f} s")
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


def verify(args):
    rows, asked = asked_rows(args)
    todo = [r for r in rows if r.verdict in (gating.APPLIES, gating.APPLIED)]
    if not todo:
        installed = [r for r in rows if r.found.verdict != gating.NOT_INSTALLED]
        if not installed:
            say(f"nothing to verify: none of the packages {'of the patches asked about' if asked else 'dspatch knows'} "
                f"is installed for {sys.executable}")
        else:
            for row in rows if asked else []:
                say(f"{row.patch.id}: {row.verdict}: {row.reason}")
            say(f"nothing to verify: {'none of the patches asked about' if asked else 'no patch'} applies here "
                f"(`dspatch check` says why)")
        return NOTHING_RAN
    accelerator, where = device(args.device)
    say(f"verify: {len(todo)} patch{'es' * (len(todo) > 1)} on {where}; each runs its reproducers on stock, then "
        f"patched, in fresh interpreters")
    verified, status = {}, 0
    for number, row in enumerate(todo, 1):
        ok, summary, outcome = _verify(row.patch, accelerator, progress=say, label=f"patch {number} of {len(todo)}: ")
        verified[row.patch.id] = {"ok": ok, "summary": summary, "scenarios": outcome}
        status = status or (0 if ok else 1)
    if args.json:
        print(check_json(todo, verified, {"device": accelerator}))
        return status
    columns = term.width()
    colour = term.colours()
    lines = [f"dspatch verify on {where}:"]
    for row in todo:
        v = verified[row.patch.id]
        lines.append(f"  {row.patch.id}: {term.paint('OK' if v['ok'] else 'FAILED', 'green' if v['ok'] else 'red', colour)}"
                     f" ({v['summary']})")
        stock, patched = v["scenarios"]["stock"], v["scenarios"]["patched"]
        for name in dict.fromkeys([*stock, *patched]):  # what each reproducer saw, in the bug's own words
            seen = stock.get(name, "not run").split("\n")[0]
            after = patched.get(name, "not run").split("\n")[0]
            lines += term.wrap(f"{name}: stock: {seen[:160]}; patched: {after[:160]}", columns, "    ", "      ")
    good = sum(v["ok"] for v in verified.values())
    lines.append(f"{good} of {len(todo)} verified: the bug shows on stock and the patch fixes it" if good == len(todo)
                 else f"{len(todo) - good} of {len(todo)} did not behave as declared: please report it with this output")
    print_lines(lines)
    return status


# ---- run ---------------------------------------------------------------------------------------------------------

def _ours(filename):
    import runpy

    here = os.path.dirname(os.path.abspath(__file__))
    return filename.startswith(here + os.sep) or filename in (runpy.__file__, "<frozen runpy>")


def run_user_code(target, module, script_args):
    """Run `target` (a script's path, or a module's name when `module`) as __main__, as `python` does: its own
    sys.argv and sys.path[0], and a failure's traceback from the user's code down (dspatch's and runpy's frames
    above it left out). Returns the exit status."""
    import runpy

    if module:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise BadInput(f"no module named {target}")
        sys.argv = [target, *script_args]  # runpy puts the module's path in argv[0]
    else:
        sys.argv = [target, *script_args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(target), run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # KeyboardInterrupt too: shown as python shows it, from the user's frames
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None and _ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # the hook prints the exception's own traceback
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return 0


def run_script(args):
    # Through the environment, so that every process the script starts (spawn workers, launchers) is
    # patched the same way, as with DSPATCH=... on the command line.
    what = f"-m {args.module}" if args.module else os.path.basename(args.script)
    try:  # a bad selection is refused before the script runs (it would run unpatched)
        if args.only is not None:
            registry.selection(args.only, source=f"--only {registry.short(','.join(args.only))}")
        selection_or_bad_input()
    except (registry.SelectionError, BadInput) as e:
        raise BadInput(f"{e}; {what} not run") from None
    if not args.module and not os.path.exists(args.script):
        raise BadInput(f"no such script: {args.script}")
    if args.only is not None:
        os.environ["DSPATCH"] = ",".join(args.only)
    elif not registry.active():
        os.environ["DSPATCH"] = "1"
    dspatch._apply(None, strict=None)
    return run_user_code(args.module or args.script, bool(args.module), args.script_args)


# ---- the parser --------------------------------------------------------------------------------------------------

COMMANDS = {"check": "what applies here, and why",
            "verify": "run the reproducers of what applies: the bug on stock, then fixed",
            "explain": "which known bug a failed job's log shows, and what to do",
            "export": "the upstream diffs for this environment, as `git am` series",
            "run": "run a script or module with dspatch active",
            "canary": "your DeepSpeed config on a tiny model against plain torch: a silent bug shows, named or not",
            "audit": "the known bugs a lock or requirements file's pins have, before installing"}


def _ids_argument(parser, what):
    parser.add_argument("ids", nargs="*", metavar="ID", help=f"{what}: patch ids, or prefixes such as 'deepspeed' "
                        "(default: what DSPATCH selects, or every patch)")
    parser.add_argument("--only", type=registry.split, default=None, metavar="IDS",
                        help="the same, comma-separated")


def parser():
    """The `dspatch` parser; its subcommands' parsers are in `.commands` ({name: parser})."""
    import argparse

    from dspatch import audit, explain, export

    top = argparse.ArgumentParser(prog="dspatch", description="Version-pinned fixes for known DeepSpeed, accelerate, "
                                  "transformers and trl bugs. Patch a job with DSPATCH=1 in its environment (every "
                                  "rank), or `dspatch run train.py`.", epilog="`dspatch` alone is `dspatch check`. "
                                  "Docs: README.md and docs/ of the source tree.")
    top.add_argument("--version", action="version", version=f"dspatch {dspatch.__version__}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    top.commands = {}

    def command(name, description=None, epilog=None):
        top.commands[name] = commands.add_parser(name, help=COMMANDS[name], description=description or COMMANDS[name],
                                                 epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        return top.commands[name]

    p = command("check", "What applies to this environment, and why: one row per patch, what applies here first.",
                "Exit 0; 1 with --strict when a patch drifted or failed; 2 for a bad DSPATCH or id.")
    _ids_argument(p, "only these")
    p.add_argument("--json", action="store_true", help="everything, as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="each patch's cause, full reason, notes and links")
    p.add_argument("--strict", action="store_true", help="exit 1 when a patch drifted or failed")

    p = command("verify", "Run the reproducers of the patches that apply here (or of the ids given), each in a fresh "
                "interpreter: stock must show the bug, the patch must fix it.",
                "Exit 0 when every one behaved as declared, 1 when one did not, 2 for bad input, 5 when nothing "
                "applies here (nothing ran).")
    _ids_argument(p, "only these")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the reproducers run: auto (default) takes DS_ACCELERATOR when set, else a CUDA device "
                   "when torch sees one, else the CPU (gloo)")
    p.add_argument("--json", action="store_true", help="the results as JSON")

    explain.arguments(command("explain", "Name the known bugs a failed job's log shows, and what to do.",
                              "Exit 0 when it names or offers a known bug, 1 when the log shows none, 2 for an "
                              "unreadable log."))
    export.arguments(command("export", export.__doc__.splitlines()[0], "\n".join(export.__doc__.splitlines()[2:])))
    p = command("run", "Run a script (or -m MODULE) with dspatch active (DSPATCH=1 unless DSPATCH or --only selects "
                "patches); the processes it starts are patched the same way.",
                "Its exit status is the script's; 2 when the selection is bad (the script does not run).")
    p.add_argument("--only", type=registry.split, default=None, metavar="IDS", help="comma-separated ids or prefixes")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as `python -m MODULE`")
    p.add_argument("script", nargs="?", help="the script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    audit.arguments(command("audit", audit.DESCRIPTION, audit.EPILOG))
    from dspatch import canary

    canary.arguments(command("canary", canary.__doc__.splitlines()[0], "\n".join(canary.__doc__.splitlines()[2:])))
    return top


# `dspatch check` with these flags alone (what users and launchers run) is read without argparse, which costs a
# sixth of a warm check; anything else (ids, --only, --help, a typo) goes to argparse
_PLAIN_FLAGS = {"--json": "json", "-v": "verbose", "--verbose": "verbose", "--strict": "strict"}


def _plain(argv):
    """The parsed arguments of `check` when argv holds only flags of _PLAIN_FLAGS, each once; else None."""
    if len(set(argv)) != len(argv) or not set(argv) <= set(_PLAIN_FLAGS) or {"-v", "--verbose"} <= set(argv):
        return None
    import types

    args = types.SimpleNamespace(command="check", ids=[], only=None, **dict.fromkeys(set(_PLAIN_FLAGS.values()),
                                                                                    False))
    for flag in argv:
        setattr(args, _PLAIN_FLAGS[flag], True)
    return args


def _run_arguments(parser, argv):
    """`dspatch run`'s arguments: --only IDS, then a script or -m MODULE; everything after that is the script's own
    (`dspatch run train.py --only x` passes --only to train.py), as `python` reads its command line."""
    import argparse

    args = argparse.Namespace(command="run", only=None, module=None, script=None, script_args=[])
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word in ("-h", "--help"):
            parser.print_help()
            parser.exit()
        elif word == "--only" or word.startswith("--only="):
            value = word.partition("=")[2] if "=" in word else (rest.pop(0) if rest else parser.error(
                "argument --only: expected one argument"))
            args.only = registry.split(value)
        elif word == "-m" or (word.startswith("-m") and len(word) > 2):
            args.module = word[2:] or (rest.pop(0) if rest else parser.error("argument -m: expected one argument"))
            break
        elif word == "--":
            args.script = rest.pop(0) if rest else None
            break
        elif word.startswith("-"):
            parser.error(f"unrecognized arguments: {word} (options go before the script)")
        else:
            args.script = word
            break
    args.script_args = rest
    return args


def dispatch(args):
    if args.command == "check":
        return check(args)
    if args.command == "verify":
        return verify(args)
    if args.command == "run":
        if not args.module and not args.script:
            raise BadInput("give a script, or -m MODULE (`dspatch run --help`)")
        return run_script(args)
    from dspatch import audit, canary, explain, export

    return {"explain": explain.command, "export": export.command, "audit": audit.command,
            "canary": canary.command}[args.command](args)


def main(argv=None):
    """The `dspatch` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _plain(argv[1:]) if argv[:1] == ["check"] else _plain([]) if not argv else None
    try:
        if args is None:
            p = parser()
            if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
                hint = f"; to run a script: dspatch run {argv[0]}" if argv[0].endswith(".py") else ""
                p.print_usage(sys.stderr)
                raise BadInput(f"{argv[0]!r} is not a command ({', '.join(COMMANDS)}){hint}")
            if argv[:1] == ["run"]:  # options up to the script or module: the rest is theirs, as python has it
                args = _run_arguments(p.commands["run"], argv[1:])
            elif argv and argv[0] in COMMANDS:  # the command's own parser: its usage in its errors
                args = p.commands[argv[0]].parse_args(argv[1:])
                args.command = argv[0]
            else:
                args = p.parse_args(argv)
            if args.command is None:
                args = _plain([])
        return dispatch(args)
    except BadInput as e:
        say(str(e))
        return 2


def run():
    """The console script's entry point."""
    term.exit_with(main)


if __name__ == "__main__":
    run()
