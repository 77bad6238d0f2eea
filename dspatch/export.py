"""Write the upstream diffs (git format-patch files with DEP-3 fields) of the patches that apply here.

    dspatch export --out prs/                   per project, the series of the patches that apply here
    dspatch export --out prs/ --all             every band of every patch, each standalone (upstream_prs/)
    dspatch export --check-against CHECKOUT     `git apply --check` of each diff that applies here on your checkout

Without --all, one series per project: the diff of each applicable patch for the installed release, in order, each
made on top of the ones before it where they change the same lines (3-way merged, as `git am -3` would), so that
`git am prs/deepspeed/*.patch` applies them all to that release's source. Exits 1 when nothing was written, when
two diffs change the same lines differently, or when --check-against finds a diff that does not apply or none of
the files (a checkout of another project is named by its project's diffs only).
"""
import argparse
import os
import shutil
import subprocess
import sys

from dspatch import data_dir, gating, status
from dspatch import upstream


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
    return any(os.path.exists(os.path.join(checkout, path)) for path in _paths(diff, existing=True))


def _installed_file(path):
    """The installed file of an upstream repository path (`deepspeed/...`, or `src/accelerate/...`), or None."""
    parts = path.split("/")
    if parts[0] == "src":
        parts = parts[1:]
    init = upstream.module_file(parts[0])
    if not init:
        return None
    found = os.path.join(os.path.dirname(os.path.dirname(init)), *parts)
    return found if os.path.isfile(found) else None


def _paths(diff, existing=False):
    """Repository paths the diff changes (`existing`: only those it finds in the release, not those it creates)."""
    with open(diff, encoding="utf-8") as f:
        starts = ("--- a/",) if existing else ("--- a/", "+++ b/")
        return sorted({line[6:].strip() for line in f if line.startswith(starts)})


def _git(folder, *args, stdin=None):
    env = {**os.environ, "GIT_AUTHOR_NAME": "dspatch", "GIT_AUTHOR_EMAIL": "dspatch@users.noreply.github.com",
           "GIT_COMMITTER_NAME": "dspatch", "GIT_COMMITTER_EMAIL": "dspatch@users.noreply.github.com"}
    return subprocess.run(["git", *args], cwd=folder, env=env, capture_output=True, text=True, input=stdin)


def _adds_all(diff, repo):
    """Whether every line the diff adds is in its file in `repo` (a check that it landed, not where)."""
    added, path = {}, None
    with open(diff, encoding="utf-8") as f:
        for line in f:
            if line.startswith("+++ b/"):
                path = line[6:].strip()
            elif line.startswith("+") and not line.startswith("+++") and path:
                added.setdefault(path, []).append(line[1:].rstrip("\n"))
    for path, lines in added.items():
        with open(os.path.join(repo, path), encoding="utf-8") as f:
            have = set(f.read().split("\n"))
        if not set(lines) <= have:
            return False
    return True


def series(diffs, out):
    """Write `diffs` (paths of one project's diffs, in order) as a `git am` series into `out`: each made on top of
    the ones before it, against the installed files. Returns the paths written; raises ValueError when a diff does
    not apply to the installed files or two diffs change the same lines differently."""
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        repo, pristine = os.path.join(work, "repo"), os.path.join(work, "pristine")
        paths = sorted({p for diff in diffs for p in _paths(diff, existing=True)})
        for folder in (repo, pristine):
            for path in paths:
                installed = _installed_file(path)
                if installed is None:
                    raise ValueError(f"{path}: not installed here")
                os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
                shutil.copyfile(installed, os.path.join(folder, path))
        _git(repo, "init", "-q")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", "installed release")
        for diff in diffs:
            alone = os.path.join(work, "alone")  # the release with this diff alone: the other side of the merge
            shutil.copytree(pristine, alone)
            _git(alone, "init", "-q")
            applied = _git(alone, "apply", diff)
            if applied.returncode:
                raise ValueError(f"{os.path.basename(diff)} does not apply to the installed files: "
                                 f"{applied.stderr.strip()[:300]}")
            merged = {}
            for path in _paths(diff):  # a 3-way merge per file: release, release + earlier diffs, release + this one
                if not os.path.exists(os.path.join(pristine, path)):  # a file the diff creates
                    with open(os.path.join(alone, path), encoding="utf-8") as f:
                        merged[path] = f.read()
                    continue
                merge = _git(repo, "merge-file", "-p", os.path.join(repo, path), os.path.join(pristine, path),
                             os.path.join(alone, path))
                merged[path] = None if merge.returncode else merge.stdout
            if None in merged.values():
                # changes next to each other conflict in a merge: the diff itself, with one line of context, on top
                on_top = _git(repo, "apply", "-C1", diff)
                if on_top.returncode or not _adds_all(diff, repo):
                    raise ValueError(f"{os.path.basename(diff)} and a diff before it change the same lines differently: "
                                     "send them as separate pull requests")
            for path, text in merged.items() if None not in merged.values() else ():
                os.makedirs(os.path.dirname(os.path.join(repo, path)), exist_ok=True)
                with open(os.path.join(repo, path), "w", encoding="utf-8") as f:
                    f.write(text)
            shutil.rmtree(alone)
            message = os.path.join(work, "message")
            with open(diff, encoding="utf-8") as f:
                info = _git(repo, "mailinfo", message, os.path.join(work, "body"), stdin=f.read())
            subject = next((line[9:] for line in info.stdout.splitlines() if line.startswith("Subject: ")), "")
            with open(message, encoding="utf-8") as f:
                body = f.read()
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{subject}\n\n{body}")
        os.makedirs(out, exist_ok=True)
        written = _git(repo, "format-patch", "-o", os.path.abspath(out), "HEAD~" + str(len(diffs)))
        if written.returncode:
            raise ValueError(written.stderr.strip())
        return written.stdout.splitlines()  # the files it wrote (not others an earlier export left in `out`)


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
    chosen = list(_chosen(args.all))
    if not chosen:
        print("dspatch: no patch applies to this environment, so there is no diff for it; --all gives every diff",
              file=sys.stderr)
        return 1
    failed = 0
    if args.out and args.all:
        for row, relative in chosen:
            target = os.path.join(args.out, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(data_dir("upstream_prs"), relative), target)
            print(f"{row.patch.id}: {target}")
    elif args.out:
        projects = {}
        for row, relative in chosen:
            projects.setdefault(relative.split("/")[0], []).append((row, relative))
        for project, items in projects.items():
            # sorted and once each: patches that share one upstream change (trl's DPO and KTO halves) share its diff
            diffs = [os.path.join(data_dir("upstream_prs"), relative) for relative in sorted({r for _, r in items})]
            try:
                written = series(diffs, os.path.join(args.out, project))
            except (ValueError, OSError) as e:
                print(f"dspatch: {project}: {e}", file=sys.stderr)
                failed += 1
                continue
            for path in written:
                print(path)
            print(f"  (`git am {os.path.join(args.out, project)}/*.patch` in a {project} checkout of the installed "
                  "release)")
    if args.check_against:
        checked = 0
        for row, relative in chosen:
            source = os.path.join(data_dir("upstream_prs"), relative)
            if not _touches(source, args.check_against):
                continue
            checked += 1
            proc = subprocess.run(["git", "apply", "--check", source], cwd=args.check_against,
                                  capture_output=True, text=True)
            ok = proc.returncode == 0
            failed += not ok
            why = "" if ok else f": {(proc.stderr.strip().splitlines() or ['?'])[0]}"
            print(f"{row.patch.id}: {relative}: {'applies' if ok else 'does not apply'}{why}")
        if not checked:
            print(f"dspatch: none of the diffs' files is in {args.check_against}: give an upstream checkout "
                  f"(deepspeed, accelerate, transformers or trl) of the installed release", file=sys.stderr)
            return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
