"""Write the upstream diffs (git format-patch files with DEP-3 fields) of the patches that apply here.

    python -m dspatch.export --out prs/ [--all]
"""
import argparse
import os
import shutil
import sys

from dspatch import data_dir, gating


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dspatch.export", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the .patch files into")
    parser.add_argument("--all", action="store_true", help="every diff, not only those of patches that apply")
    args = parser.parse_args(argv)
    wanted = (gating.APPLIES, gating.APPLIED)
    written = 0
    for row in gating.check_all():
        if not args.all and row.verdict not in wanted:
            continue
        for relative in row.patch.diffs.values():
            source = os.path.join(data_dir("upstream_prs"), relative)
            target = os.path.join(args.out, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(source, target)
            print(f"{row.patch.id}: {target}")
            written += 1
    if not written:
        print("no patch applies to this environment; --all writes every diff", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
