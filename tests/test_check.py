"""`python -m dspatch.apply --check`: reads, never imports; tells the truth about this environment."""
import json
import os

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import clean_env, deepspeed_version, run_python

HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "trl", "wrapt")


def test_check_imports_no_target_and_no_torch():
    code = ("import sys, json, contextlib, io\n"
            "from dspatch.cli import legacy_main as main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    rc = main(['--check', '--json'])\n"
            "print(json.dumps({'rc': rc, 'report': json.loads(out.getvalue()), 'modules': sorted(sys.modules)}))\n")
    proc = run_python(["-c", code], env=clean_env(DSPATCH="1"))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    imported = {m.split(".")[0] for m in result["modules"]}
    assert not imported & set(HEAVY), imported & set(HEAVY)
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


def test_check_table_names_every_patch_and_why():
    """One aligned line per patch (id, package==version, verdict, a few words of why), as `pip list` prints;
    the summary, full reason, note and links under -v; the same verdicts as --json."""
    proc = run_python(["-m", "dspatch.apply", "--check"])
    lines = proc.stdout.splitlines()
    assert "DSPATCH is not set" in lines[0]
    *table, hint = lines[1:]
    # under the table, where the installed releases have any: the known bugs no patch fixes, as --json lists them
    known = table[table.index(""):] if "" in table else []
    header, rule, *rows = table[:len(table) - len(known)]
    assert header.split() == ["patch", "package", "verdict", "why"] and set(rule) == {"-", " "}
    rows_json = dspatch_check_rows()
    assert len(rows) == len(rows_json) == len(registry.all_patches())
    column = header.index("verdict")
    for line, row in zip(rows, rows_json):
        assert line.startswith(row["id"] + " ") and line[column:].startswith(row["verdict"]), (line, row)
    unpatched = json.loads(run_python(["-m", "dspatch.apply", "--check", "--json"]).stdout)["unpatched"]
    assert [line.split()[0] for line in known[2:]] == [k["id"] for k in unpatched]
    assert not known or known[1].startswith(f"Known bugs of these releases that dspatch does not patch ({len(unpatched)})")
    assert "-v" in hint and "why: " not in proc.stdout
    verbose = run_python(["-m", "dspatch.apply", "--check", "-v"]).stdout
    assert "why: " in verbose and "https://github.com/deepspeedai/DeepSpeed/issues/6772" in verbose


def test_malformed_dspatch_is_a_clear_error():
    proc = run_python(["-m", "dspatch.apply", "--check"], env=clean_env(DSPATCH="deepspeed/zero3-moduleid"),
                      check=False)
    assert proc.returncode == 2
    assert "DSPATCH='deepspeed/zero3-moduleid' is an unknown patch id" in proc.stderr
    assert "known ids: deepspeed/zero3-module-id" in proc.stderr


def test_disabled_patch_says_so():
    proc = run_python(["-m", "dspatch.apply", "--check", "--json"],
                      env=clean_env(DSPATCH="1", DSPATCH_DISABLE="deepspeed/zero3-module-id"))
    row = json.loads(proc.stdout)["patches"][0]
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
    assert empty.returncode == 2 and "--only '' names no patch" in empty.stderr
    bogus = run_python(["-m", "dspatch.apply", "--only", "bogus", str(script)], check=False)
    assert bogus.returncode == 2 and "SCRIPT RAN" not in bogus.stdout
    assert "--only 'bogus' is an unknown patch id" in bogus.stderr and "not run" in bogus.stderr
    commas = run_python(["-m", "dspatch.apply", "--check"], env=clean_env(DSPATCH=",,"), check=False)
    assert commas.returncode == 2 and "DSPATCH=',,' names no patch" in commas.stderr
    at_runtime = run_python(["-c", "import dspatch; print(dspatch.apply(None))"], env=clean_env(DSPATCH=",,"))
    assert "names no patch" in at_runtime.stderr and at_runtime.stdout.strip() == "{}"
    huge = run_python(["-m", "dspatch.apply", "--check"], env=clean_env(DSPATCH="y" * 100_000), check=False)
    from dspatch import registry

    known = len(", ".join(registry.all_patches()))  # the message lists the known ids; the value itself is cut
    assert huge.returncode == 2 and len(huge.stderr) < 400 + known and huge.stderr.count("(100000 characters)") == 1


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
    projects = sorted({path.split("/")[0] for path in expected})
    assert sorted(folder.name for folder in out.iterdir()) == projects
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

    import importlib

    apply = importlib.import_module("dspatch.cli")
    flags = list(apply._PLAIN_FLAGS)
    for n in range(len(flags) + 1):
        for argv in itertools.permutations(flags, n) if n < 3 else itertools.combinations(flags, n):
            fast = apply._plain(list(argv))
            if fast is not None:
                assert vars(fast) == vars(apply._parser().parse_args(list(argv))), argv
    assert apply._plain(["--check", "--check"]) is None and apply._plain(["--only", "x"]) is None
    assert apply._plain(["train.py"]) is None and apply._plain(["-v", "--verbose"]) is None
