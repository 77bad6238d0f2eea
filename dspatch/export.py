"""Write the upstream diffs (git format-patch files with DEP-3 fields) of the patches that apply here.

    python -m dspatch.export --out prs/                   the diff for each installed release a patch applies to
    python -m dspatch.export --out prs/ --all             every band of every patch
    python -m dspatch.export --check-against CHECKOUT     `git apply --check` of those diffs on your checkout

Without --all, exactly one diff per applicable patch is written: the band of the installed release, so that
`git am prs/deepspeed/*.patch` works on that release's source. Exits 1 when nothing was written.
"""
import argparse
import os
import shutil
import subprocess
import sys

from dspatch import data_dir, gating, status


def _chosen(everything):
    for row in status.check_all():
        if everything:
            for relative in row.patch.diffs.values():
                yield row, relative
        elif row.verdict in (gating.APPLIES, gating.APPLIED) and row.version:
            relative = row.patch.diff_for(row.version)
            if relative:
                yield row, relative


def _touches(diff, checkout):
    """Whether a file the diff changes exists in the checkout (a deepspeed checkout holds no accelerate file)."""
    with open(diff, encoding="utf-8") as f:
        paths = [line[6:].strip() for line in f if line.startswith("--- a/")]
    return any(os.path.exists(os.path.join(checkout, path)) for path in paths)


def main(argv=None, prog="python -m dspatch.export"):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--out", help="directory to write the .patch files into")
    parser.add_argument("--all", action="store_true", help="every band of every patch, not only what applies here")
    parser.add_argument("--check-against", metavar="CHECKOUT",
                        help="run `git apply --check` of the chosen diffs in this upstream checkout, a line each")
    args = parser.parse_args(argv)
    if not args.out and not args.check_against:
        parser.error("give --out DIR, --check-against CHECKOUT, or both")
    written, failed = 0, 0
    for row, relative in _chosen(args.all):
        source = os.path.join(data_dir("upstream_prs"), relative)
        if args.out:
            target = os.path.join(args.out, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(source, target)
            print(f"{row.patch.id}: {target}")
        if args.check_against and not _touches(source, args.check_against):
            print(f"{row.patch.id}: {relative}: skipped (its files are not in {args.check_against}: a checkout of "
                  f"another project)")
        elif args.check_against:
            proc = subprocess.run(["git", "apply", "--check", source], cwd=args.check_against,
                                  capture_output=True, text=True)
            ok = proc.returncode == 0
            failed += not ok
            why = "" if ok else f": {(proc.stderr.strip().splitlines() or ['?'])[0]}"
            print(f"{row.patch.id}: {relative}: {'applies' if ok else 'does not apply'}{why}")
        written += 1
    if not written:
        print("dspatch: no patch applies to this environment, so there is no diff for it; --all gives every diff",
              file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
