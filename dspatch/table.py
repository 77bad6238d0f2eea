"""The README's patch table, generated from the registry (a test fails when README.md is stale).

    python -m dspatch.table            print it
    python -m dspatch.table --write    rewrite the blocks between the markers in README.md (patches, proofs)
"""
import os
import sys

from dspatch import registry

START, END = "<!-- patch-table:start -->", "<!-- patch-table:end -->"
PROOF_START, PROOF_END = "<!-- proof-table:start -->", "<!-- proof-table:end -->"


def markdown():
    lines = ["| id | fixes | affected | fixed upstream | written for | upstream | diffs (`upstream_prs/`) |",
             "|---|---|---|---|---|---|---|"]
    for pid, p in registry.all_patches().items():
        links = " ".join(f"[{link.rsplit('/', 2)[-2].rstrip('s')} {link.rsplit('/', 1)[-1]}]({link})"
                         for link in p.links)
        diffs = "<br>".join(f"`{path}` ({band})" for band, path in p.diffs.items())
        lines.append(f"| `{pid}` | {p.summary} | {p.distribution} {p.affected} | {p.fixed_in or 'not yet'} | "
                     f"{p.supported or 'all affected'} | {links} | {diffs} |")
    return "\n".join(lines)


def proofs():
    """Per patch: its reproducers, what each does, and the exact failure stock must show."""
    lines = ["| patch | reproducer | what it runs | stock must fail with |", "|---|---|---|---|"]
    for pid, p in registry.all_patches().items():
        for name, scenario in p.scenarios.items():
            doc = " ".join((scenario.__doc__ or "").split()).split(". ")[0].rstrip(".")
            fragment, releases = p.declared_on_stock.get(name, (None, None))
            shown = f"`{fragment}`{f' ({p.distribution} {releases})' if releases else ''}" if fragment \
                else "passes on stock too"
            lines.append(f"| `{pid}` | `{name}` | {doc} | {shown} |")
    return "\n".join(lines)


def block():
    return f"{START}\n{markdown()}\n{END}"


def proof_block():
    return f"{PROOF_START}\n{proofs()}\n{PROOF_END}"


def rewrite(text):
    for start, end, new in ((START, END, block()), (PROOF_START, PROOF_END, proof_block())):
        head, rest = text.split(start, 1)
        text = head + new + rest.split(end, 1)[1]
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--write" not in argv:
        print(markdown())
        return 0
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    text = open(path).read()
    open(path, "w").write(rewrite(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
