"""Name the known bugs a failed job's log shows, and say what to do about each here.

    python -m dspatch.explain job.log
    some-command 2>&1 | python -m dspatch.explain -

Each patch declares the log lines its bug produces on stock upstream (`Patch.signatures`: regular expressions,
one line each; a tuple of them must all match, in that order). The log is only read: nothing in it is executed
or imported. Before matching, each line loses ANSI colour codes, carriage-return progress redraws (tqdm keeps
the last one), and launcher prefixes such as `[rank1]:`, `[default0]:` or `rank0: `, so interleaved ranks and
coloured, truncated logs still match.

Exit status: 0 when a known bug was found, 1 when none was (the log says so), 2 when the log cannot be read.
"""
import argparse
import json
import os
import re
import sys

# ESC [ ... final byte, and other two-character escapes
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
# launcher prefixes: torchrun --tee/--role ([default0]:), torch's elastic logs ([rank1]:), deepspeed's launcher
# ("0: ", "rank0: "), slurm --label ("0: "); applied repeatedly ("[rank1]:[rank1]: " happens)
_PREFIX = re.compile(r"^\s*(?:\[(?:rank|default|worker)?\d+\]:|(?:rank)?\d{1,4}:(?=\s))\s?")
# what a log line is cut to before matching (very long lines are tensor dumps, not error messages)
_LINE_LIMIT = 4000


def clean_lines(text):
    """The log's lines as a reader sees them: no colour codes, no progress redraws, no rank prefixes."""
    # "\n" only: str.splitlines() would also split at the "\r" of a progress redraw
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for raw in lines:
        line = _ANSI.sub("", raw)
        if "\r" in line:  # a progress bar redrawn in place: what remains on screen is the last segment
            line = [part for part in line.split("\r") if part.strip()][-1:] or [""]
            line = line[0]
        for _ in range(3):
            stripped = _PREFIX.sub("", line, count=1)
            if stripped == line:
                break
            line = stripped
        yield line[:_LINE_LIMIT].rstrip()


def _compile(signature):
    parts = signature if isinstance(signature, tuple) else (signature,)
    return tuple(re.compile(p) for p in parts)


def find(lines, patches):
    """[(patch, line number (1-based) of the last line the signature needed, that line)] in registry order."""
    found = []
    for patch in patches:
        for signature in patch.signatures:
            pattern = _compile(signature)
            at, hit = 0, None
            for number, line in enumerate(lines, 1):
                if pattern[at].search(line):
                    at += 1
                    if at == len(pattern):
                        hit = (number, line)
                        break
            if hit:
                found.append((patch, *hit))
                break
    return found


def advice(patch, environ=None):
    """(verdict, reason, active, what to do) for this environment."""
    from dspatch import gating, registry

    env = os.environ if environ is None else environ
    version, verdict, reason = gating.evaluate(patch)
    try:
        selected = patch.id in registry.selection(None, env, "DSPATCH")[0] if registry.flag("DSPATCH", env) else False
    except registry.SelectionError:
        selected = False
    link = patch.links[0] if patch.links else ""
    if verdict == gating.APPLIES:
        if selected:
            todo = ("it is active here (DSPATCH selects it); if this log comes from a job run with it active, "
                    "the fix did not hold: please report it with the log")
        else:
            todo = f"set DSPATCH=1 (or DSPATCH={patch.id}) for the job, on every rank"
    elif verdict == gating.FIXED_UPSTREAM:
        todo = (f"this environment has {patch.distribution} {version}, which has upstream's fix: the log came from "
                f"an older one; upgrade there to {patch.fixed_in} or later, or run it here")
    elif patch.fixed_in:
        todo = f"upgrade {patch.distribution} to {patch.fixed_in} or later (fixed upstream)"
    else:
        todo = f"open upstream, see {link}" if link else "open upstream"
        if verdict == gating.DRIFTED:
            todo += "; dspatch leaves this install alone because its source is not a known release's"
    return verdict, reason, selected, todo


def explain(text, patches=None, environ=None):
    from dspatch import registry

    patches = list(registry.all_patches().values()) if patches is None else patches
    lines = list(clean_lines(text))
    report = []
    for patch, number, line in find(lines, patches):
        verdict, reason, active, todo = advice(patch, environ)
        report.append({"id": patch.id, "line": number, "text": line, "cause": patch.summary, "verdict": verdict,
                       "reason": reason, "active": active, "do": todo, "links": list(patch.links)})
    return len(lines), report


def _read(source):
    if source == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(source, "rb") as f:
            data = f.read()
    return data.decode("utf-8", errors="replace")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dspatch.explain",
                                     description="Name the known bugs a failed job's log shows (exit 0), or say "
                                                 "that it shows none (exit 1).")
    parser.add_argument("log", nargs="?", default="-", help="the log file, or - for standard input (default)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = parser.parse_args(argv)
    try:
        text = _read(args.log)
    except OSError as e:
        print(f"dspatch.explain: cannot read {args.log}: {e.strerror or e}", file=sys.stderr)
        return 2
    count, report = explain(text)
    try:
        if args.json:
            print(json.dumps({"lines": count, "bugs": report}))
        elif not report:
            print(f"No known bug found in {count} lines of {'standard input' if args.log == '-' else args.log}. "
                  f"dspatch knows: {', '.join(_known_ids())}.")
        for item in [] if args.json else report:
            print(f"{item['id']}: {item['cause']}")
            print(f"  seen at line {item['line']}: {item['text'][:200]}")
            print(f"  here: {item['verdict']} ({item['reason']}){'; active' if item['active'] else ''}")
            print(f"  do: {item['do']}")
        sys.stdout.flush()
    except BrokenPipeError:  # piped into head: end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report else 1


def _known_ids():
    from dspatch import registry

    return [pid for pid, p in registry.all_patches().items() if p.signatures]


if __name__ == "__main__":
    sys.exit(main())
