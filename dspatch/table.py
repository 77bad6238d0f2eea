"""The README's patch table, generated from the registry (a test fails when README.md is stale).

    python -m dspatch.table            print it
    python -m dspatch.table --write    rewrite the block between the markers in README.md
"""
import os
import sys

from dspatch import registry

START, END = "<!-- patch-table:start -->", "<!-- patch-table:end -->"


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


def block():
    return f"{START}\n{markdown()}\n{END}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--write" not in argv:
        print(markdown())
        return 0
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    text = open(path).read()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    open(path, "w").write(head + block() + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
