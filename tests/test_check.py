"""`python -m dspatch.apply --check`: reads, never imports; tells the truth about this environment."""
import json
import os

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import clean_env, deepspeed_version, run_python

HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "trl", "wrapt")


def test_check_imports_no_target_and_no_torch():
    for entry in ("from dspatch.cli import main\nrc = main(['check', '--json'])",
                  "from dspatch.legacy import main\nrc = main(['--check', '--json'])"):
        code = ("import sys, json, contextlib, io\n"
                "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
                + "".join(f"    {line}\n" for line in entry.splitlines()) +
                "print(json.dumps({'rc': rc, 'report': json.loads(out.getvalue()), 'modules': sorted(sys.modules)}))\n")
        proc = run_python(["-c", code], env=clean_env(DSPATCH="1"))
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        imported = {m.split(".")[0] for m in result["modules"]}
        assert not imported & set(HEAVY), imported & set(HEAVY)
        assert "argparse" not in result["modules"]  # the plain flags are read without it
        assert result["rc"] == 0
        rows = {r["id"]: r for r in result["report"]["patches"]}
        row = rows["deepspeed/zero3-module-id"]
        version = deepspeed_version()
        assert row["version"] == version
        if version is None:
            assert row["verdict"] == gating.NOT_INSTALLED
        else:
            from packaging.version import Version

            expected = gating.APPLIES if Version(version) <= Version("0.16.3") else gating.FIXED_UPSTREAM
            assert row["verdict"] == expected, row


def shown(text):
    """{patch id: what the plain check says of it}: its verdict, "applies" in the first group, or "not installed"
    for a package shown as one line."""
    ids = registry.all_patches()
    found, group, package = {}, None, None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            group = line.split(" (")[0]
            continue
        words = line.split()
        if not words:
            continue
        if group.startswith("Apply here") and words[0] in ids:
            found[words[0]] = words[1] if len(words) > 1 and words[1] in (gating.APPLIED, gating.DISABLED) \
                else gating.APPLIES
        elif group.startswith("Need a look") and words[0] in ids:
            found[words[0]] = " ".join(words[1:3]) if words[1] == "broken" else words[1]
        elif line.startswith("  ") and not line.startswith("    ") and words[0].rstrip(":") in \
                {p.distribution for p in ids.values()}:
            package = words[0].rstrip(":")
            if line.rstrip().endswith(("patch)", "patches)")) and "not installed" in line:
                found.update({pid: gating.NOT_INSTALLED for pid, p in ids.items() if p.distribution == package})
        elif line.startswith("    ") and f"{package}/{words[0]}" in ids:
            verdict = next(v for v in (gating.FIXED_UPSTREAM, gating.NOT_AFFECTED, gating.NOT_INSTALLED,
                                       gating.UNSUPPORTED, gating.DISABLED, gating.DRIFTED)
                           if line[4 + len(words[0]):].strip().startswith(v))
            found[f"{package}/{words[0]}"] = verdict
    return found


def test_check_table_names_every_patch_and_why():
    """What applies here first, then the rest by package (a package not installed as one line), one summary line;
    the same verdicts as --json; the cause, full reason, note and links under -v."""
    proc = run_python(["-m", "dspatch", "check"])
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"dspatch {__import__('dspatch').__version__} for ")
    assert "DSPATCH is not set" in lines[1]
    rows_json = dspatch_check_rows()
    assert len(rows_json) == len(registry.all_patches())
    seen = shown(proc.stdout)
    for row in rows_json:
        assert seen.get(row["id"]) == row["verdict"], (row["id"], seen.get(row["id"]), row["verdict"])
    here = sum(row["verdict"] == gating.APPLIES for row in rows_json)
    assert f"{here} of {len(rows_json)} apply here" in proc.stdout
    assert "-v" in lines[-1] and "why: " not in proc.stdout
    unpatched = json.loads(run_python(["-m", "dspatch.apply", "--check", "--json"]).stdout)["unpatched"]
    if unpatched:
        assert f"Known bugs of these releases that dspatch does not patch ({len(unpatched)})" in proc.stdout
    verbose = run_python(["-m", "dspatch", "check", "-v", "deepspeed/zero3-module-id"]).stdout
    assert "why: " in verbose and "https://github.com/deepspeedai/DeepSpeed/issues/6772" in verbose
    assert registry.all_patches()["deepspeed/zero3-module-id"].cause in verbose
    assert run_python(["-m", "dspatch.apply", "--check"]).stdout == proc.stdout  # the first releases' form


def test_malformed_dspatch_is_a_clear_error():
    proc = run_python(["-m", "dspatch.apply", "--check"], env=clean_env(DSPATCH="deepspeed/zero3-moduleid"),
                      check=False)
    assert proc.returncode == 2
    assert proc.stderr == ("dspatch: DSPATCH='deepspeed/zero3-moduleid' is an unknown patch id (did you mean "
                           "deepspeed/zero3-module-id?); nothing is applied\n")


def test_disabled_patch_says_so():
    proc = run_python(["-m", "dspatch.apply", "--check", "--json"],
                      env=clean_env(DSPATCH="1", DSPATCH_DISABLE="deepspeed/zero3-module-id"))
    row = next(r for r in json.loads(proc.stdout)["patches"] if r["id"] == "deepspeed/zero3-module-id")
    assert row["verdict"] == gating.DISABLED and "DSPATCH_DISABLE" in row["reason"]


def test_export_writes_the_diffs(tmp_path):
    run_python(["-m", "dspatch.export", "--out", str(tmp_path), "--all"])
    from dspatch import registry

    # a diff two patches share (DPO's and KTO's halves of one trl change) is written once
    expected = sorted({path for p in registry.all_patches().values() for path in p.diffs.values()})
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.patch"))
    assert written == expected
    first = registry.all_patches()["deepspeed/zero3-module-id"].diffs[">=0.14.0,<=0.15.3"]
    assert "Applied-Upstream: 0.16.4" in (tmp_path / first).read_text()


def test_run_a_script_with_dspatch_active(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, subprocess, sys, dspatch._hook as hook, dspatch._runtime as runtime\n"
                      "child = subprocess.run([sys.executable, '-c', 'import sys; print(\"dspatch._boot\" in sys.modules)'],"
                      " capture_output=True, text=True).stdout.strip()\n"
                      "print(runtime.state.active, hook.finder() is not None, child, os.environ['DSPATCH'], sys.argv[1:])\n")
    out = run_python(["-m", "dspatch.apply", str(script), "--lr", "3"]).stdout.strip().splitlines()[-1]
    assert out == "True True True 1 ['--lr', '3']"  # children (spawn workers, launchers) are patched too
    out = run_python(["-m", "dspatch.apply", "--only", "deepspeed", str(script)]).stdout.strip().splitlines()[-1]
    assert out == "True True True deepspeed []"


def test_selection_edge_cases_on_the_command_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('SCRIPT RAN')\n")
    empty = run_python(["-m", "dspatch.apply", "--check", "--only", ""], check=False)
    assert empty.returncode == 2 and "--only '' names no patch" in empty.stderr, empty.stderr
    bogus = run_python(["-m", "dspatch.apply", "--only", "bogus", str(script)], check=False)
    assert bogus.returncode == 2 and "SCRIPT RAN" not in bogus.stdout
    assert "--only 'bogus' is an unknown patch id" in bogus.stderr and "not run" in bogus.stderr
    commas = run_python(["-m", "dspatch.apply", "--check"], env=clean_env(DSPATCH=",,"), check=False)
    assert commas.returncode == 2 and "DSPATCH=',,' names no patch" in commas.stderr
    at_runtime = run_python(["-c", "import dspatch; print(dspatch.apply(None))"], env=clean_env(DSPATCH=",,"))
    assert "names no patch" in at_runtime.stderr and at_runtime.stdout.strip() == "{}"
    huge = run_python(["-m", "dspatch.apply", "--check"], env=clean_env(DSPATCH="y" * 100_000), check=False)
    assert huge.returncode == 2 and len(huge.stderr) < 300 and huge.stderr.count("(100000 characters)") == 1


def test_files_without_metadata_are_a_broken_install_not_absent(tmp_path):
    """A damaged install (dist-info deleted, files still there): say what is there; --strict fails."""
    from dspatch import registry

    patch = registry.all_patches()["deepspeed/zero3-module-id"]
    for module in patch.modules:
        path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        for parent in path.parents:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
    env = clean_env(PYTHONPATH=str(tmp_path))
    proc = run_python(["-m", "dspatch.apply", "--check", "--strict"], env=env, check=False)
    if deepspeed_version() is None:
        assert proc.returncode == 1 and "broken install" in proc.stdout
        assert "metadata (dist-info) is missing" in proc.stdout


@pytest.mark.stack
def test_export_writes_series_that_git_am_applies_to_the_released_source(tmp_path, deepspeed_copy):
    """What a new user does: export, then `git am` each project's series, in order, on the installed release's source
    as released (its sdist): every diff of every patch that applies here lands, those that change neighbouring
    lines of one file included; --check-against a deepspeed checkout says of each deepspeed diff that it applies."""
    import shutil
    import subprocess

    from dspatch import data_dir, export, registry

    from upstream_releases import release_tree

    site, _ = deepspeed_copy
    out = tmp_path / "prs"
    proc = run_python(["-m", "dspatch.export", "--out", str(out), "--check-against", site], check=False)
    rows = {r["id"]: r for r in dspatch_check_rows()}
    per_patch = [registry.all_patches()[pid].diff_for(r["version"]) for pid, r in rows.items()
                 if r["verdict"] == gating.APPLIES]
    # a set: patches that share one upstream change (trl's DPO and KTO halves) share its diff, written once
    expected = sorted(set(per_patch))
    if not expected:
        assert proc.returncode == 1 and "no patch applies" in proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours = [path for path in expected if path.startswith("deepspeed/")]  # the checkout given is deepspeed's
    assert proc.stdout.count(": applies") == len([path for path in per_patch if path in ours])
    again = run_python(["-m", "dspatch.export", "--out", str(out)], check=False)  # into the same folder: replaced
    assert again.returncode == 0 and "replaced the" in again.stdout, again.stdout + again.stderr
    projects = sorted({path.split("/")[0] for path in expected})
    assert sorted(folder.name for folder in out.iterdir() if folder.is_dir()) == projects
    for project in projects:
        diffs = [os.path.join(data_dir("upstream_prs"), path) for path in expected if path.startswith(project + "/")]
        written = sorted((out / project).glob("*.patch"))
        assert len(written) == len(diffs), (project, written)
        version = upstream.installed_version(project)
        paths = sorted({p for diff in diffs for p in export._paths(diff, existing=True)})
        repo = tmp_path / f"{project}-{version}"
        shutil.copytree(release_tree(project, version, paths), repo)
        for command in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                                                        "-m", "release"]):
            subprocess.run(["git", *command], cwd=repo, check=True)
        am = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "am", *map(str, written)], cwd=repo,
                            capture_output=True, text=True)
        assert am.returncode == 0, (project, am.stdout, am.stderr)
        assert all(export._adds_all(diff, str(repo)) for diff in diffs), project


def test_export_check_against_a_folder_without_the_files_is_an_error(tmp_path):
    proc = run_python(["-m", "dspatch.export", "--all", "--check-against", str(tmp_path)], check=False)
    assert proc.returncode == 1 and "none of the diffs' files is in" in proc.stderr, proc


def dspatch_check_rows():
    return json.loads(run_python(["-m", "dspatch.apply", "--check", "--json"]).stdout)["patches"]


def test_plain_flags_read_without_argparse_as_argparse_reads_them():
    import itertools

    from dspatch import cli, legacy

    for module, parse, flags in ((legacy, legacy._parser().parse_args, list(legacy._PLAIN_FLAGS)),
                                 (cli, lambda argv: cli.parser().commands["check"].parse_args(argv),
                                  list(cli._PLAIN_FLAGS))):
        for n in range(len(flags) + 1):
            for argv in itertools.permutations(flags, n) if n < 3 else itertools.combinations(flags, n):
                fast = module._plain(list(argv))
                if fast is not None:
                    expected = {k: v for k, v in vars(parse(list(argv))).items()}
                    assert {k: v for k, v in vars(fast).items() if k in expected} == expected, argv
        assert module._plain(["--json", "--json"]) is None and module._plain(["--only", "x"]) is None
        assert module._plain(["train.py"]) is None and module._plain(["-v", "--verbose"]) is None
