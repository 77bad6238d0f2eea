"""`dspatch check`: the verdicts grouped (what applies here first, what needs a look, the rest by package), fitted to
the terminal and coloured on one, a summary line; or JSON."""
import json
import os
import sys

import dspatch
from dspatch import gating, registry, term

from dspatch.asked import asked_rows

PROBLEMS = (gating.DRIFTED, gating.FAILED, gating.BROKEN)
PACKAGES = ("deepspeed", "accelerate", "transformers", "trl")

_PAINT = {gating.APPLIES: "yellow", gating.APPLIED: "green", gating.DRIFTED: "red", gating.FAILED: "red",
          gating.BROKEN: "red", gating.DISABLED: "dim"}


def _environment():
    return {k: os.environ[k] for k in ("DSPATCH", "DSPATCH_DISABLE", "DSPATCH_STRICT") if os.environ.get(k)}


def _state():
    if not registry.active():
        return "DSPATCH is not set: nothing is applied until you set DSPATCH=1 (or a list of ids)"
    return "active: patches marked 'applies' are applied when their package is imported"


def _summary(rows, asked):
    here = [r for r in rows if r.found.verdict == gating.APPLIES or r.verdict == gating.APPLIED]
    applied = [r for r in here if r.verdict == gating.APPLIED]
    of = f"{len(here)} of {len(rows)}{' asked about' if asked else ''} apply here"
    if applied:
        return f"{of}: {len(applied)} applied in this process"
    if not here:
        return f"{of}: nothing to apply"
    if not registry.active() and not asked:
        return f"{of}; DSPATCH is not set, so none is applied (DSPATCH=1 applies {'it' if len(here) == 1 else 'them'})"
    left = [r for r in here if r.verdict == gating.DISABLED]
    if asked:
        return f"{of}; DSPATCH={','.join(r.patch.id for r in here)} applies {'it' if len(here) == 1 else 'them'}"
    if left:
        return f"{of}: {len(here) - len(left)} applied when their packages are imported, {len(left)} left out by " \
               f"the selection"
    return f"{of}: applied when their packages are imported"


def _table(rows, short_ids, columns, colour, verbose, indent="  "):
    """Lines of one group: id, verdict and a few words of why, the why wrapped to the terminal."""
    from dspatch import status

    name = (lambda row: row.patch.id.split("/", 1)[1]) if short_ids else (lambda row: row.patch.id)
    same = len({row.verdict for row in rows}) == 1 and rows[0].verdict == gating.APPLIES  # the heading says it
    shown = [(name(row), "" if same else row.verdict, status.brief(row, limit=200), row) for row in rows]
    w_id = max(len(s[0]) for s in shown)
    w_verdict = max(len(s[1]) for s in shown)
    start = len(indent) + w_id + 2 + (w_verdict + 2 if w_verdict else 0)
    lines = []
    for ident, verdict, why, row in shown:
        head = f"{indent}{ident.ljust(w_id)}  "
        painted = term.paint(verdict, _PAINT.get(verdict, ""), colour)
        if not why:
            lines.append((head + painted).rstrip())
        elif columns - start >= 20:
            wrapped = term.wrap(why, columns, " " * start)
            pad = " " * (w_verdict - len(verdict) + 2) if w_verdict else ""
            lines.append(head + painted + pad + wrapped[0][start:])
            lines += wrapped[1:]
        else:
            lines.append(head + painted)
            lines += term.wrap(why, columns, indent + "    ")
        if verbose:
            more = indent + "    "
            lines += term.wrap(f"{row.patch.cause or row.patch.summary}", columns, more)
            lines += term.wrap(f"why: {row.reason}", columns, more, more + "  ")
            if row.patch.note and row.verdict in (gating.APPLIES, gating.APPLIED):
                lines += term.wrap(f"note: {row.patch.note}", columns, more, more + "  ")
            lines += [f"{more}see: {link}" for link in row.patch.links]
    return lines


def _group(rows):
    """(apply here, need a look, {package: rest}) in registry order."""
    here = [r for r in rows if r.verdict in (gating.APPLIES, gating.APPLIED)
            or (r.verdict == gating.DISABLED and r.found.verdict == gating.APPLIES)]
    look = [r for r in rows if r.verdict in PROBLEMS]
    rest = {}
    for r in sorted(rows, key=lambda r: PACKAGES.index(r.patch.distribution) if r.patch.distribution in PACKAGES
                    else len(PACKAGES)):  # stable: registry order within a package
        if r not in here and r not in look:
            rest.setdefault(r.patch.distribution, []).append(r)
    return here, look, rest


def check_text(rows, asked, verbose, columns, colour):
    here, look, rest = _group(rows)
    python = f"{sys.executable} (Python {sys.version.split()[0]})"
    lines = [*term.fit(f"dspatch {dspatch.__version__} for {python}", columns), *term.fit(_state(), columns)]
    env = _environment()
    if env:
        lines += term.fit("  " + " ".join(f"{k}={registry.short(v)}" for k, v in env.items()), columns)
    if here:
        lines += ["", f"Apply here ({len(here)}): these releases have the bug"] + \
            _table(here, False, columns, colour, verbose)
    if look:
        lines += ["", f"Need a look ({len(look)}): left out, nothing changed"] + \
            _table(look, False, columns, colour, verbose)
    if rest:
        lines += ["", "The others, by package:" if here or look else "By package:"]
        for package, group in rest.items():
            version = group[0].version
            if not asked and all(r.found.verdict == gating.NOT_INSTALLED for r in group):
                lines.append(f"  {package}: not installed ({len(group)} patch{'es' * (len(group) > 1)})")
                continue
            lines.append(f"  {package} {version}:" if version else f"  {package}:")
            lines += _table(group, True, columns, colour, verbose, indent="    ")
    installed = {r.patch.distribution for r in rows if r.found.verdict != gating.NOT_INSTALLED}
    lines.append("")
    if not installed and not asked:
        lines += term.fit(f"None of {', '.join(PACKAGES)} is installed for {sys.executable}: run dspatch with the "
                          f"training environment's Python (`that-python -m dspatch check`).", columns)
    lines += term.fit(_summary(rows, asked), columns)
    unpatched = _known_here()
    if unpatched:
        lines += ["", f"Known bugs of these releases that dspatch does not patch ({len(unpatched)}):"]
        for known, version in unpatched:
            fix = f"fixed in {known.fixed_in}" if known.fixed_in else "open upstream"
            lines += term.wrap(f"{known.id} ({known.distribution}=={version}): {known.effect}; {fix}; meanwhile: "
                               f"{known.advice}", columns, "  ", "    ")
    if not verbose:
        lines += term.fit("(-v: each patch's cause, full reason and links; --json: everything)", columns)
    return lines


def check_json(rows, verified=None, extra=None):

    out = {"dspatch": dspatch.__version__, "python": sys.executable, "environment": _environment(),
           "state": _state(), **(extra or {}), "patches": []}
    for row in rows:
        d = row.as_dict()
        if verified and row.patch.id in verified:
            d["verify"] = verified[row.patch.id]
        out["patches"].append(d)
    out["unpatched"] = [{"id": k.id, "distribution": k.distribution, "version": v, "effect": k.effect,
                         "affected": k.affected, "fixed_in": k.fixed_in, "advice": k.advice,
                         "links": list(k.links)} for k, v in _known_here()]
    return json.dumps(out, indent=2)


def check(args):
    rows, asked = asked_rows(args)
    status = 1 if args.strict and any(r.verdict in PROBLEMS for r in rows) else 0
    if args.json:
        print(check_json(rows))
        return status
    print_lines(check_text(rows, asked, args.verbose, term.width(), term.colours()))
    return status


def print_lines(lines):
    sys.stdout.write("\n".join(lines) + "\n")


def _known_here():
    """[(Known, installed version)] of the known bugs no patch fixes that the installed releases have."""
    from dspatch.known import KNOWN, present

    names = {n for k in KNOWN for n in (k.distribution, *k.requires)}
    installed = {n: gating.installed_version(n) for n in names}
    return [(k, installed[k.distribution]) for k in present(installed)]
