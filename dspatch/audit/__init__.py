"""`dspatch audit`: the known bugs a lock or requirements file's pins have, which dspatch fixes, and the smallest
upgrade that clears them all without dspatch. Before anything is installed: nothing of the pinned packages is
imported or needed, only their names and versions.

    dspatch audit requirements.txt [constraints.txt ...]     (-r/-c includes, markers, hashes; `pip freeze` output)
    dspatch audit uv.lock | poetry.lock | pylock.toml        (- reads standard input)
    dspatch audit --pins "deepspeed==0.16.9 transformers==4.46.3 torch==2.6.0"

Each patch gets the verdict `dspatch check` would give with those versions installed (applies, fixed upstream, not
affected, unsupported; "not pinned" where the pins do not name its package), decided from its declaration and from
the source of each release that the release suite read (tests/test_releases.py). A range pin gets the verdicts of
the releases it admits (dspatch.releases lists them). Known bugs no patch fixes (dspatch.known) are listed where
the pins have them. The upgrade it proposes minds what each release requires of the other pinned packages
(dspatch.requires, read from the released files).

Exit status (for CI): 0 when every known bug the pins have is fixed by a dspatch patch (or none is there); 1 when one
is there that no patch fixes (with --strict: when any known bug is there); 2 when an input cannot be read (which
line, and why).
"""
import argparse
import json
import sys

from dspatch import gating, registry
from dspatch.known import KNOWN
from dspatch.versions import Version

from dspatch.audit.pins import Pin, Unreadable, canonical, read_pins
from dspatch.audit.upgrades import pin_conflicts, requirements, upgrade
from dspatch.audit.verdicts import NOT_PINNED, PRESENT, judge_pin, other_releases, release_span, decide, has_bug

__all__ = ["DESCRIPTION", "EPILOG", "NOT_PINNED", "PRESENT", "Pin", "Unreadable", "pin_conflicts", "arguments", "audit",
           "canonical", "command", "decide", "exit_status", "has_bug", "main", "read_pins", "requirements", "upgrade"]


def audit(pins):
    """{"patches": [...], "unpatched": [...], "upgrade": {...}}: each patch's verdict, the known bugs without a
    patch that the pins have, and the smallest upgrade that clears every known bug without dspatch."""
    rows = []
    for patch in registry.all_patches().values():
        pin = pins.get(canonical(patch.distribution))
        row = {"id": patch.id, "distribution": patch.distribution, "pin": pin.text if pin else None,
               "fixed_in": patch.fixed_in, "effect": patch.summary}
        releases = pin.releases() if pin else []
        if not pin:
            row.update(verdict=NOT_PINNED, reason=f"{patch.distribution} is not pinned")
        elif not releases:
            row.update(verdict=NOT_PINNED, reason=f"no release of {patch.distribution} that dspatch knows matches "
                                                  f"{pin.text}")
        else:
            verdicts = {v: decide(patch, v, pins) for v in releases}
            row["verdict"], row["reason"] = judge_pin(verdicts, pin)
            if len(releases) > 1:
                row["releases"] = {v: verdict for v, (verdict, _) in verdicts.items()}
        rows.append(row)
    unpatched = []
    for known in KNOWN:
        pin = pins.get(canonical(known.distribution))
        releases = pin.releases() if pin else []
        having = [v for v in releases if has_bug(known, v, pins)]  # (Known.has, with the pins' ranges)
        if having:
            notes = other_releases(known, pins)[1]
            unpatched.append({"id": known.id, "distribution": known.distribution, "pin": pin.text,
                              "releases": having if len(releases) > 1 else None, "verdict": PRESENT,
                              "effect": known.effect, "affected": known.affected, "fixed_in": known.fixed_in,
                              "advice": known.advice, "links": list(known.links), "notes": notes})
    return {"patches": rows, "unpatched": unpatched, "upgrade": upgrade(pins)}



# ---- output -------------------------------------------------------------------------------------------------------

def exit_status(report, strict=False):
    fixed_by_patch = [r for r in report["patches"] if r["verdict"] == gating.APPLIES]
    unfixed = [r for r in report["patches"] if r["verdict"] == gating.UNSUPPORTED] + report["unpatched"]
    return 1 if unfixed or (strict and fixed_by_patch) else 0


def _lines(report, pins, sources, verbose):
    out = [f"dspatch audit: {', '.join(sources)}: {len(pins)} packages pinned"]
    for name in ("deepspeed", "transformers", "accelerate", "trl", "peft", "torch"):
        if name in pins:
            out[-1] += f"; {name}{pins[name].text}" if not pins[name].versions else \
                f"; {name} {' or '.join(pins[name].versions)}"
    applies = [r for r in report["patches"] if r["verdict"] == gating.APPLIES]
    unsupported = [r for r in report["patches"] if r["verdict"] == gating.UNSUPPORTED]
    width = max((len(r["id"]) for r in report["patches"]), default=0)
    out += ["", f"Known bugs these pins have that dspatch fixes ({len(applies)}): DSPATCH=1 applies the patch"]
    out += [f"  {r['id']:<{width}}  {r['reason']}" for r in applies] or ["  none"]
    if unsupported:
        out += ["", f"Known bugs these pins have that the patch is not written for ({len(unsupported)}):"]
        out += [f"  {r['id']:<{width}}  {r['reason']}" for r in unsupported]
    out += ["", f"Known bugs these pins have that dspatch does not patch ({len(report['unpatched'])}):"]
    for k in report["unpatched"]:
        fix = f"fixed in {k['distribution']} {k['fixed_in']}" if k["fixed_in"] else "open upstream"
        which = f" ({release_span(k['releases'])} of the pin)" if k["releases"] else ""
        out += [f"  {k['id']}{which}: {k['effect']}; {fix}; meanwhile: {k['advice']}"]
    if not report["unpatched"]:
        out += ["  none"]
    rest = [r for r in report["patches"] if r["verdict"] not in (gating.APPLIES, gating.UNSUPPORTED)]
    if verbose:
        out += ["", "The other patches:"] + [f"  {r['id']:<{width}}  {r['verdict']}: {r['reason']}" for r in rest]
    else:
        counts = {}
        for r in rest:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        out += ["", "The other patches: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + " (-v: each)"]
    up = report["upgrade"]
    out += ["", "Upgrading instead:"]
    if up["per_bug"]:
        fixed = {bug: first for bug, first in up["per_bug"].items() if first}
        out += [f"  {bug.split('/')[0]} {first} clears {bug}" for bug, first in
                sorted(fixed.items(), key=lambda item: (item[0].split("/")[0], Version(item[1])))]
        if up["to"]:
            out += ["  the smallest upgrade that clears them without dspatch: " +
                    ", ".join(f"{n} {a} -> {b}" for n, (a, b) in sorted(up["to"].items()))]
            out += [f"    {n} moves because {why}" for n, why in sorted(up["because"].items())]
        if up["not_cleared"]:
            out += [f"  it leaves (no release of their package is free of all at once): {', '.join(up['not_cleared'])}"]
        if up["introduced"]:
            out += [f"  it brings in (the pins do not have them): {', '.join(up['introduced'])}"]
        if up["open"]:
            out += [f"  no release clears these yet: {', '.join(up['open'])}"]
    else:
        out += ["  none needed: the exact pins have no known bug"]
    if up["ranges_not_considered"]:
        out += [f"  (range pins not upgraded: {', '.join(up['ranges_not_considered'])}; pin exact versions to get one)"]
    return out


DESCRIPTION = ("The known bugs a lock or requirements file's pins have (before installing), which dspatch fixes, and "
               "the smallest upgrade that clears them.")
EPILOG = ("Exit 0 when the pins have no known bug dspatch cannot fix (1 with --strict when they have any), 1 when they "
          "have one it cannot, 2 for a file it cannot read. docs/audit.md has the formats.")


def arguments(parser):
    parser.add_argument("files", nargs="*", metavar="FILE", help="requirements/constraints files, `pip freeze` "
                        "output, uv.lock, poetry.lock, pylock.toml (- for standard input)")
    parser.add_argument("-r", "--requirement", dest="more", action="append", default=[], metavar="FILE",
                        help="a requirements file, as pip takes it (the same as FILE)")
    parser.add_argument("-c", "--constraint", dest="more", action="append", metavar="FILE",
                        help="a constraints file, as pip takes it: its pins count as pins")
    parser.add_argument("--pins", default="", help='pins given inline: "deepspeed==0.16.9 torch==2.6.0"')
    parser.add_argument("--json", action="store_true", help="one JSON object (docs/audit.md)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any known bug is there, patched or not")
    parser.add_argument("-v", "--verbose", action="store_true", help="every patch's verdict and reason")
    return parser


def command(args, prog="dspatch audit"):
    files = [*args.files, *args.more]
    if not files and not args.pins:
        print(f"usage: {prog} FILE... [-c FILE] [--pins PINS] [--json] [--strict] [-v]\n{prog}: give a file or "
              f"--pins", file=sys.stderr)
        return 2
    try:
        pins = read_pins(files, args.pins)
    except Unreadable as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    report = audit(pins)
    code = exit_status(report, args.strict)
    if args.json:
        body = {"inputs": files + (["--pins"] if args.pins else []),
                "pins": {n: {"spec": p.spec or None, "versions": p.versions or None, "where": p.where}
                         for n, p in sorted(pins.items())}, **report, "exit": code}
        print(json.dumps(body, indent=1))
    else:
        from dspatch import term

        term.out(_lines(report, pins, files + (["--pins"] if args.pins else []), args.verbose))
    return code


def main(argv=None, prog="python -m dspatch.audit"):
    parser = arguments(argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG))
    return command(parser.parse_args(argv), prog)

