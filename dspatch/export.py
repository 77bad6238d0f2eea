"""Write the upstream diffs (git format-patch files with DEP-3 fields) of the patches that apply here.

    dspatch export --out prs/                   per project, the series of the patches that apply here
    dspatch export --out prs/ --all             every band of every patch, each standalone (upstream_prs/)
    dspatch export --check-against CHECKOUT     `git apply --check` of each diff that applies here on your checkout
                                                (or on the installed packages: --check-against a site-packages)

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
    """Write `diffs` (paths of one project's diffs, in order) as a `git am` series into `out`, each under its own
    file name (so the series sorts as given): each made on top of the ones before it, against the installed files.
    Returns the paths written; raises ValueError when a diff does not apply to the installed files or two diffs
    change the same lines differently."""
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
        written = _git(repo, "format-patch", "-o", os.path.join(work, "series"), "HEAD~" + str(len(diffs)))
        if written.returncode:
            raise ValueError(written.stderr.strip())
        os.makedirs(out, exist_ok=True)
        paths = []
        for made, diff in zip(written.stdout.splitlines(), diffs):
            paths.append(os.path.join(out, os.path.basename(diff)))
            shutil.copyfile(made, paths[-1])
        return paths


def arguments(parser):
    parser.add_argument("--out", metavar="DIR", help="folder to write the .patch files into (new or empty, or one an "
                        "earlier export wrote: its files are replaced)")
    parser.add_argument("--all", action="store_true", help="every band of every patch, not only what applies here")
    parser.add_argument("--check-against", metavar="CHECKOUT",
                        help="`git apply --check` each chosen diff in this upstream checkout (or a site-packages), a "
                        "line each")
    return parser


MARK = ".dspatch-export"  # in --out: the files dspatch wrote there, which a later export may replace


def _make_room(out, names):
    """Prepare `out` for the files `names` (paths relative to it): refuse a folder holding .patch files dspatch did
    not write (git am would take them too); remove those an earlier export wrote. Returns how many it removed."""
    mark = os.path.join(out, MARK)
    ours = set()
    if os.path.isfile(mark):
        with open(mark, encoding="utf-8") as f:
            ours = {line.strip() for line in f if line.strip()}
    projects = {name.split("/")[0] for name in names}
    present = [os.path.relpath(os.path.join(root, name), out).replace(os.sep, "/")
               for project in projects for root, _, files in os.walk(os.path.join(out, project))
               for name in files if name.endswith(".patch")]
    foreign = sorted(set(present) - ours)
    if foreign:
        raise ValueError(f"{out} already holds {len(foreign)} .patch file{'s' * (len(foreign) > 1)} dspatch did not "
                         f"write ({foreign[0]}{', ...' if len(foreign) > 1 else ''}), which `git am` would take too: "
                         f"give a new or empty folder")
    for name in present:
        os.remove(os.path.join(out, name))
    return len(present)


def _record(out, names):
    os.makedirs(out, exist_ok=True)
    mark = os.path.join(out, MARK)
    kept = set()
    if os.path.isfile(mark):
        with open(mark, encoding="utf-8") as f:
            kept = {line.strip() for line in f if line.strip()}
    kept = {name for name in kept if os.path.exists(os.path.join(out, name))} | set(names)
    with open(mark, "w", encoding="utf-8") as f:
        f.write("".join(f"{name}\n" for name in sorted(kept)))


def _strip(diff, checkout):
    """The -p level at which the diff's files are in `checkout`: 1 for an upstream checkout, 2 for a folder that
    holds the packages themselves (a site-packages: `src/accelerate/...` is `accelerate/...` there); None: neither."""
    paths = _paths(diff, existing=True)
    if any(os.path.exists(os.path.join(checkout, path)) for path in paths):
        return 1
    inner = [path.split("/", 1)[1] for path in paths if path.startswith("src/")]
    if any(os.path.exists(os.path.join(checkout, path)) for path in inner):
        return 2
    return None


def command(args, prog="dspatch export"):
    if not args.out and not args.check_against:
        print(f"usage: {prog} (--out DIR | --check-against CHECKOUT) [--all]\n{prog}: give --out DIR, "
              f"--check-against CHECKOUT, or both", file=sys.stderr)
        return 2
    from dspatch import registry

    try:
        chosen = list(_chosen(args.all))
    except registry.SelectionError as e:
        print(f"dspatch: {e}; nothing is applied", file=sys.stderr)
        return 2
    if not chosen:
        print("dspatch: no patch applies to this environment, so there is no diff for it; --all gives every diff",
              file=sys.stderr)
        return 1
    failed = 0
    if args.out:
        names = sorted({relative for _, relative in chosen})
        try:
            replaced = _make_room(args.out, names)
        except (ValueError, OSError) as e:
            print(f"dspatch: {e}", file=sys.stderr)
            return 2
        if replaced:
            print(f"(replaced the {replaced} files of an earlier dspatch export in {args.out})")
    if args.out and args.all:
        for relative in names:
            target = os.path.join(args.out, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(data_dir("upstream_prs"), relative), target)
            print(target)
        _record(args.out, names)
    elif args.out:
        projects = {}
        for row, relative in chosen:
            projects.setdefault(relative.split("/")[0], set()).add(relative)
        for project, relatives in projects.items():
            # sorted and once each: patches that share one upstream change (trl's DPO and KTO halves) share its diff
            ordered = sorted(relatives)
            diffs = [os.path.join(data_dir("upstream_prs"), relative) for relative in ordered]
            try:
                written = series(diffs, os.path.join(args.out, project))
            except (ValueError, OSError) as e:
                print(f"dspatch: {project}: {e}", file=sys.stderr)
                failed += 1
                continue
            for path in written:  # the names upstream_prs/ gives them, which sort in the series' order
                print(path)
            _record(args.out, ordered)
            print(f"  (`git am {os.path.join(args.out, project)}/*.patch` in a {project} checkout of the installed "
                  "release)")
    if args.check_against:
        checked = 0
        for row, relative in chosen:
            source = os.path.join(data_dir("upstream_prs"), relative)
            level = _strip(source, args.check_against)
            if level is None:
                continue
            checked += 1
            proc = subprocess.run(["git", "apply", "--check", f"-p{level}", source], cwd=args.check_against,
                                  capture_output=True, text=True)
            ok = proc.returncode == 0
            failed += not ok
            why = "" if ok else f": {(proc.stderr.strip().splitlines() or ['?'])[0]}"
            print(f"{row.patch.id}: {relative}: {'applies' if ok else 'does not apply'}{why}")
        if not checked:
            print(f"dspatch: none of the diffs' files is in {args.check_against}: give an upstream checkout "
                  f"(deepspeed, accelerate, transformers or trl) of the installed release, or its site-packages",
                  file=sys.stderr)
            return 1
    return 1 if failed else 0


def main(argv=None, prog="python -m dspatch.export"):
    parser = arguments(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                               formatter_class=argparse.RawDescriptionHelpFormatter,
                                               epilog="\n".join(__doc__.splitlines()[2:])))
    return command(parser.parse_args(argv), prog)


if __name__ == "__main__":
    from dspatch import term

    term.exit_with(main)
