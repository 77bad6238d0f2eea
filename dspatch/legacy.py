"""`python -m dspatch.apply`: the first releases' command line, kept working as documented (the `dspatch` command,
dspatch.cli, is the one to use). Its forms:

    python -m dspatch.apply --check [--json] [-v] [--strict] [--verify] [--only IDS]
    python -m dspatch.apply [--only IDS] script.py [args...]
"""
import sys

from dspatch import cli, registry

# `--check` with these flags alone (what launchers and the benchmarks run) is read without argparse
_PLAIN_FLAGS = {"--check": "check", "--json": "json", "-v": "verbose", "--verbose": "verbose", "--strict": "strict",
                "--verify": "verify"}


def _plain(argv):
    """The parsed arguments when argv holds only flags of _PLAIN_FLAGS, each once; else None."""
    if len(set(argv)) != len(argv) or not set(argv) <= set(_PLAIN_FLAGS) or {"-v", "--verbose"} <= set(argv):
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
                                     "with dspatch active; the `dspatch` command does both and more",
                                     epilog="dspatch check, dspatch run: the same, as subcommands")
    parser.add_argument("--check", action="store_true", help="show every patch's verdict here, and why")
    parser.add_argument("--json", action="store_true", help="with --check: machine-readable output")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="with --check: each patch's cause, full reason, notes and links")
    parser.add_argument("--strict", action="store_true", help="with --check: exit 1 if a patch drifted or failed")
    parser.add_argument("--verify", action="store_true",
                        help="with --check: run each applicable patch's reproducers, stock and patched (dspatch verify)")
    parser.add_argument("--only", type=registry.split, default=None, metavar="IDS",
                        help="comma-separated patch ids or prefixes instead of DSPATCH")
    parser.add_argument("script", nargs="?", help="a Python script to run with dspatch active")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def _command(args):
    args.ids = []
    if args.script:
        if args.check:
            raise cli.BadInput("--check takes no script: run `--check` alone, or a script without it")
        args.module = None
        return cli.run_script(args)
    if args.verify:
        args.device = "auto"
        return cli.verify(args)
    return cli.check(args)  # `--check` is the default: the module alone shows the verdicts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _plain(argv)
        return _command(args if args is not None else _parser().parse_args(argv))
    except cli.BadInput as e:
        cli.say(str(e))
        return 2


if __name__ == "__main__":
    from dspatch import term

    term.exit_with(main)
