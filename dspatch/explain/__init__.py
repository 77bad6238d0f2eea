"""Name the known bugs a failed job's log shows, and say what to do about each here.

    dspatch explain job.log            (or python -m dspatch.explain job.log; job.log.gz, UTF-16 logs too)
    some-command 2>&1 | dspatch explain -

Each patch declares how its bug shows in a log (`Patch.signatures`, dspatch.spec.Signature): the message, the
exception it belongs to, and the frames or lines that tell it from other failures with the same words. The log is
only read: nothing in it is executed or imported. Before matching, each line loses ANSI colour codes,
carriage-return progress redraws (tqdm keeps the last one) and launcher prefixes such as `[rank1]:`, `[default0]:`
or `rank0: `; a debugger's `Exception has occurred: X` is read with the message under it, and a message wrapped
over lines (or under an empty `SomeError:` line) is read joined.

A wrong name sends a user to a fix for a bug they do not have, so a name is given only when the log decides it:
where two known bugs give the same message and the log's frames and versions cannot tell them apart, both are
listed as candidates, with what to look at, and neither is asserted; so is a bug whose lines a failure that no
patch fixes also writes, unless a line of the log points to the bug. Each verdict says how sure it is and why:
the line that matched, the lines that decided, and the versions taken into account (printed in the log, or, to
choose between candidates only, those of this environment).

A message whose bug the versions installed here do not have (the log printing none) is set aside, said as such:
if the log came from another machine, its versions there decide.

Exit status: 0 when a known bug (a choice of two, or one set aside) was found, 1 when none was (the log says so),
2 when the log cannot be read.
"""
import argparse
import json
import sys

from dspatch.explain.lines import clean_lines, log_versions
from dspatch.explain.match import advice, explain, find
from dspatch.explain.logfile import Unreadable, open_log, skim

__all__ = ["Unreadable", "advice", "arguments", "clean_lines", "command", "explain", "find", "log_versions", "main",
           "open_log", "skim"]


def _lines(bugs, choices, aside, count, source):
    out = []
    if not bugs and not choices and not aside:
        out.append(f"No known bug found in {count} lines of {'standard input' if source == '-' else source}. "
                   f"dspatch knows the log lines of {len(_known_ids())} bugs (`dspatch check -v` lists every patch).")
    for item in bugs:
        out.append(f"{item['cause']} ({item['id']})")
        out.append(f"  seen at line {item['line']}: {item['text'][:200]}")
        out.append(f"  {item['confidence']}" + (f": {'; '.join(item['why'])}" if item["why"] else ""))
        if item["versions"]:
            out.append("  versions: " + ", ".join(f"{k} {v}" for k, v in item["versions"].items()))
        out.append(f"  fix: {item['fix']}")
        out.append(f"  here: {item['verdict']} ({item['reason']}){'; active' if item['active'] else ''}")
        out.append(f"  do: {item['do']}")
    for item in choices:
        known = f"one of {len(item['ids'])} known bugs" if len(item["ids"]) > 1 else "a known bug"
        out.append(f"line {item['line']} shows {known}{', or a failure no patch fixes,' if item['also'] else ''} and "
                   f"the log does not say which: {item['text'][:200]}")
        out += [f"  ({why})" for why in item["why"]]
        for candidate in item["candidates"]:
            out.append(f"  - {candidate['id']}: {candidate['cause']}")
            if candidate["tell"]:
                out.append(f"    it is this one if {candidate['tell']}")
            out.append(f"    here: {candidate['verdict']} ({candidate['reason']}); do: {candidate['do']}")
        out += [f"  - or, with no dspatch fix: {other}" for other in item["also"]]
    for item in aside:
        out.append(f"line {item['line']} has the message of {item['id']} ({item['cause']}), which this environment "
                   f"does not have: {item['ruled_out']}; {item['do']}")
        out.append(f"  seen: {item['text'][:200]}")
    return out


def arguments(parser):
    parser.add_argument("log", nargs="?", default="-", help="the log file (.gz too), or - for standard input "
                        "(default)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    return parser


def command(args, prog="dspatch explain"):
    if args.log == "-" and sys.stdin.isatty():
        print(f"usage: {prog} LOG [--json]\n{prog}: give a log file, or pipe one in (`... 2>&1 | {prog} -`)",
              file=sys.stderr)
        return 2
    from dspatch import registry

    try:
        registry.selection()  # what `here:` says reads DSPATCH: a bad value is refused, as by every command
    except registry.SelectionError as e:
        print(f"dspatch: {e}; nothing is applied", file=sys.stderr)
        return 2
    try:
        with open_log(args.log) as f:
            text = skim(f, list(registry.all_patches().values()))
    except (OSError, EOFError, Unreadable) as e:  # EOFError: a gzip cut short
        print(f"{prog}: cannot read {'standard input' if args.log == '-' else args.log}: "
              f"{getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    count, bugs, choices, aside = explain(text)
    if args.json:
        print(json.dumps({"lines": count, "bugs": bugs, "undecided": choices, "set_aside": aside}))
    else:
        from dspatch import term

        term.out(_lines(bugs, choices, aside, count, args.log))
    return 0 if bugs or choices or aside else 1


def main(argv=None, prog="python -m dspatch.explain"):
    parser = arguments(argparse.ArgumentParser(prog=prog, description="Name the known bugs a failed job's log "
                                               "shows (exit 0), or say that it shows none (exit 1)."))
    return command(parser.parse_args(argv), prog)


def _known_ids():
    from dspatch import registry

    return [pid for pid, p in registry.all_patches().items() if p.signatures]

