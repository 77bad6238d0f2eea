"""The pages about the patches, generated from the registry (a unit test fails when one is stale).

    python -m dspatch.docs            list what would change
    python -m dspatch.docs --write    rewrite them: docs/patches/README.md (a table per package, every
                                      declaration and reproducer), one page per patch, docs/patches/<id>.md,
                                      and docs/known-unpatched.md (dspatch.known)

The README names no patch: it links to each package's table here, so adding a patch leaves it as it is.

A patch's page is its module docstring (the bug's story, written once), its declaration, how its verdict is
decided release by release, the functions it changes with the fingerprints of their released source, its upstream
diffs, its `explain` signatures and its reproducers: nothing on it is written by hand anywhere else.
"""
import importlib
import os
import sys

from dspatch import registry

def checkout():
    """The source checkout the pages belong to: this package's parent in an editable install, else the current
    directory when it is a checkout (a wheel's package sits in site-packages, beside no README)."""
    parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for root in (parent, os.getcwd()):
        if os.path.isfile(os.path.join(root, "README.md")) and os.path.isdir(os.path.join(root, "upstream_prs")):
            return root
    raise SystemExit("dspatch.docs: run it in a dspatch source checkout (no README.md and upstream_prs/ here)")


def page_path(pid):
    """docs/patches/<distribution>/<name>.md, relative to the repository root."""
    return f"docs/patches/{pid}.md"


def _cell(text):
    return " ".join(str(text).split()).replace("|", "\\|")


def _links(patch):
    return " ".join(f"[{link.rsplit('/', 2)[-2].rstrip('s')} {link.rsplit('/', 1)[-1]}]({link})"
                    for link in patch.links)


def releases_cell(patch):
    """Affected releases and upstream's fix in one short cell: `0.15.4 → 0.19.2` (from 0.15.4 until 0.19.2 fixed
    it), `all → open` (every release, not fixed upstream); a range of another shape is shown as its specifier."""
    lower, fixed = "all", patch.fixed_in or "open"
    parts = [part.strip() for part in patch.affected.split(",") if part.strip() not in (">=0", "")]
    for part in parts:
        if part.startswith(">=") and lower == "all":
            lower = part[2:]
        elif not (patch.fixed_in and (part == f"<{patch.fixed_in}" or part.startswith("<="))):
            return f"{patch.affected} → {fixed}"  # e.g. an upper bound where upstream removed the code
    return f"{lower} → {fixed}"


def short_table():
    """A table per package (each under a heading, which the README links to): what a user needs to recognise a bug
    and whether it is theirs."""
    by_package = {}
    for pid, p in registry.all_patches().items():
        by_package.setdefault(p.distribution, []).append((pid, p))
    lines = []
    for package, patches in by_package.items():
        lines += [f"## {package}", "", "| patch | on stock | affected → fixed |", "|---|---|---|"]
        lines += [f"| [{pid.split('/', 1)[1]}]({pid}.md) | {_cell(p.symptom or p.summary)} | "
                  f"{releases_cell(p)} |" for pid, p in patches]
        lines.append("")
    return "\n".join(lines[:-1])


def full_table():
    lines = ["| id | fixes | affected | fixed upstream | written for | upstream | diffs (`upstream_prs/`) |",
             "|---|---|---|---|---|---|---|"]
    for pid, p in registry.all_patches().items():
        diffs = "<br>".join(f"`{path}` ({band})" for band, path in p.diffs.items())
        lines.append(f"| [`{pid}`]({pid}.md) | {_cell(p.summary)} | "
                     f"{p.distribution} {p.affected} | {p.fixed_in or 'not yet'} | {p.supported or 'all affected'} | "
                     f"{_links(p)} | {diffs} |")
    return "\n".join(lines)


def _on(patch, releases):
    """A Proof.stock_fails_on value in words: "deepspeed <0.18.0, transformers <4.40.0 or >=4.52.0"."""
    from dspatch.spec import stock_fails_on

    spans = stock_fails_on(patch.distribution, releases)
    return ", ".join(f"{name} {' or '.join(specs)}" for name, specs in spans.items())


def _proof_rows(patch, with_patch=True):
    rows = []
    for name, scenario in patch.scenarios.items():
        doc = _cell((scenario.__doc__ or "").split(". ")[0].rstrip("."))
        fragment, releases = patch.declared_on_stock.get(name, (None, None))
        shown = f"`{fragment}`{f' ({_on(patch, releases)})' if releases else ''}" if fragment \
            else "passes on stock too"
        rows.append((f"| `{patch.id}` | " if with_patch else "| ") + f"`{name}` | {doc} | {_cell(shown)} |")
    return rows


def proof_table():
    lines = ["| patch | reproducer | what it runs | stock must fail with |", "|---|---|---|---|"]
    for patch in registry.all_patches().values():
        lines += _proof_rows(patch)
    return "\n".join(lines)


def index_page():
    return "\n".join([
        "# The patches", "",
        "Generated by `python -m dspatch.docs --write` from the registry (`dspatch/patches/`); a test fails when it is stale.",
        "By package: what you see on stock, and the releases from the first with the bug to the first with upstream's "
        "fix (`all`: every release dspatch knows; `open`: not fixed upstream). Each name links to its page: the bug, "
        "the fix, the releases, the diffs, the reproducers. `dspatch check` says which apply to your environment.",
        "", short_table(), "",
        "## Every declaration", "",
        full_table(), "",
        "## Reproducers", "",
        "Each runs real upstream code (`dspatch verify <id>`). Stock must fail with exactly the text shown; with the "
        "patch, and with the upstream diff applied to a copy of the installed package, every one passes.", "",
        proof_table(), ""])


def known_page():
    """docs/known-unpatched.md, from dspatch.known: what `dspatch check` and `dspatch audit` list."""
    from dspatch.known import KNOWN

    lines = ["# Known bugs not patched yet", "",
             "Generated by `python -m dspatch.docs --write` from `dspatch/known.py`. `dspatch check` lists those of the "
             "installed releases, `dspatch audit` those of a lock or requirements file's pins ([audit](audit.md)); "
             "when a patch for one lands, its entry leaves this list.", ""]
    if not KNOWN:
        return "\n".join(lines + ["None today: every known bug of this catalogue has a patch."]) + "\n"
    lines += ["| bug | what it does to a run | affected | fixed upstream | meanwhile |", "|---|---|---|---|---|"]
    for k in KNOWN:
        needs = "".join(f", with {other}{wanted}" for other, wanted in k.requires.items() if wanted != ">=0")
        lines.append(f"| `{k.id}` | {_cell(k.effect)} | {k.distribution} {k.affected}{needs} | {k.fixed_in or 'not yet'}"
                     f" | {_cell(k.advice)} |")
    lines += ["", "Upstream:", ""]
    lines += [f"- `{k.id}`: " + ", ".join(k.links) + (f". {k.note}" if k.note else "") for k in KNOWN]
    return "\n".join(lines) + "\n"


def _story(patch):
    module = importlib.import_module(patch.reproducers.rpartition(".")[0])
    # the docstring's first paragraph is its summary (the page gives the declaration's); the story is the rest
    return (module.__doc__ or "").strip().partition("\n\n")[2].strip()


def _verdicts(patch):
    out = [f"- releases with the bug: {patch.distribution} `{patch.affected}`"
           + (f", with {', '.join(f'{d} `{s}`' for d, s in patch.requires.items())}" if patch.requires else "")]
    out.append(f"- fixed upstream in: {patch.fixed_in}" if patch.fixed_in else
               "- fixed upstream in: no release yet (open): a future release whose source of every target is "
               "unchanged gets the fix; a changed one is reported as drifted")
    if patch.supported:
        out.append(f"- written and tested for: `{patch.supported}` (older releases with the bug: unsupported, "
                   "left alone)")
    checked = patch.releases_checked
    if checked:
        out.append(f"- every release from {checked[0]} to {checked[-1]} is checked from its released source "
                   "(tests/test_releases.py): verdict, fingerprints, diff band")
    out.append("- applied only where the installed source of every target is one recorded below (comments and "
               "formatting aside); any other source is `drifted` and left alone")
    return out


def _targets(patch):
    rows = ["| function | module | released source (fingerprint: releases) |", "|---|---|---|"]
    for t in patch.all_targets:
        prints = "<br>".join(f"`{fp}`: {releases}" for fp, releases in t.fingerprints.items())
        where = f" (releases {t.releases})" if t.releases else ""
        rows.append(f"| `{t.qualname}` | `{t.module}`{where} | {prints} |")
    return rows


def _signatures(patch):
    if not patch.signatures:
        why = patch.silent
        return [f"No log signature: {why}." if why else "No log signature."]
    rows = [f"Silent outside {patch.distribution} {patch.loud_on}: {patch.silent}.", ""] if patch.loud_on else []
    rows += ["| error | message (regular expression) | also needs |", "|---|---|---|"]
    for s in patch.signatures:
        needs = "<br>".join(f"`{n}`" if isinstance(n, str) else _cell(n.__doc__ or n.__name__)
                            for n in (*s.needs, *s.context, *s.hints))
        rows.append(f"| {s.error or ''} | `{_cell(s.message)}` | {needs} |")
    return rows


def patch_page(pid):
    p = registry.all_patches()[pid]
    links = _links(p)
    lines = [f"# {pid}", "", "<!-- generated by `python -m dspatch.docs --write` from the patch's module: edit "
             "that, not this page -->", "", f"{p.summary}.".replace("..", "."), ""]
    if p.cause:
        lines += [f"**What goes wrong:** {p.cause}.", ""]
    if p.symptom:
        lines += [f"**What you see on stock:** {p.symptom}", ""]
    lines += ["| | |", "|---|---|", f"| package | {p.distribution} |", f"| affected | `{p.affected}` |",
              f"| fixed upstream | {p.fixed_in or 'not yet'} |", f"| written for | `{p.supported or 'all affected'}` |"]
    lines += [f"| also needs | {d} `{s}` |" for d, s in p.requires.items()]
    lines += [f"| upstream | {links} |" if links else "| upstream | |",
              f"| turn on | `DSPATCH={pid}` (or `DSPATCH=1` for every patch) |", ""]
    story = _story(p)
    if story:
        lines += ["## The bug and the fix", "", story, ""]
    if p.note:
        lines += ["## While it is applied", "", p.note, ""]
    lines += ["## Verdicts", "", *_verdicts(p), "", "## What it changes", "", *_targets(p), ""]
    lines += ["## Upstream diffs", "", "Each applies with `git apply`/`git am` to the releases of its band "
              "(`dspatch export --out DIR` writes the one for the installed release).", "",
              "| releases | file |", "|---|---|"]
    lines += [f"| `{band}` | [`{path}`](../../../upstream_prs/{path}) |" for band, path in p.diffs.items()]
    lines += ["", "## In a log (`dspatch explain`)", "", *_signatures(p), ""]
    lines += ["## Reproducers", "", f"`dspatch verify {pid}` runs them on real upstream code, stock then patched.",
              "", "| reproducer | what it runs | stock must fail with |", "|---|---|---|",
              *_proof_rows(p, with_patch=False), ""]
    return "\n".join(lines)


def expected(root=None):
    """{path relative to the repository root: content} of every generated page."""
    root = root or checkout()
    pages = {"docs/patches/README.md": index_page(), "docs/known-unpatched.md": known_page()}
    for pid in registry.all_patches():
        pages[page_path(pid)] = patch_page(pid)
    return pages


def stale(root=None):
    """Paths whose content differs from what the registry generates, and generated pages of no patch."""
    root = root or checkout()
    found = []
    pages = expected(root)
    for path, content in pages.items():
        full = os.path.join(root, path)
        if not os.path.exists(full) or open(full, encoding="utf-8").read() != content:
            found.append(path)
    folder = os.path.join(root, "docs", "patches")
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.relpath(os.path.join(dirpath, name), root)
            if path.endswith(".md") and path not in pages:
                found.append(path)
    return sorted(found)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--write" not in argv:
        changed = stale()
        print("\n".join(changed) if changed else "every generated page is current")
        return 1 if changed else 0
    root = checkout()
    pages = expected(root)
    for path in stale(root):
        full = os.path.join(root, path)
        if path not in pages:
            os.remove(full)
            continue
        os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(pages[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
