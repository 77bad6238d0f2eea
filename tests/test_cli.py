"""The `dspatch` command as a new user meets it (issue 48): the installed console script, run as a user runs it, its
exit codes and what it prints. Unit session (no stack: every patch is `not installed` there); the few checks that
need a patch to apply run on a stack (marked)."""
import json
import os
import subprocess
import sys

import pytest

import dspatch
from dspatch import cli, gating, registry, term

from conftest import ROOT, clean_env, run_python

COMMAND = os.path.join(os.path.dirname(sys.executable), "dspatch")
ID = "deepspeed/engine-module-hint"  # a patch of every deepspeed release
LOG = os.path.join(ROOT, "dspatch", "patches", "accelerate", "deepspeed_no_sync", "logs", "hf-nosync-01.log")  # a real user's log (its header aside)
unit = pytest.mark.unit_only


def dspatch_command(*args, env=None, cwd=None, stdin=""):
    """The installed `dspatch`, in a neutral folder, standard input empty unless given."""
    return subprocess.run([COMMAND, *args], env=env or clean_env(), cwd=cwd or ROOT + "/..", capture_output=True,
                          text=True, input=stdin, timeout=600)


def one_line(proc, path=None):
    """The single line a refusal prints: no traceback, nothing else; short, but for the user's own path in it."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines[0].replace(str(path), "DIR") if path else lines[0]) < 200, lines[0]
    return lines[0]


@unit
def test_version_and_python_m_dspatch():
    assert dspatch_command("--version").stdout.strip() == f"dspatch {dspatch.__version__}"
    same = run_python(["-m", "dspatch", "--version"])
    assert same.stdout.strip() == f"dspatch {dspatch.__version__}"
    assert json.loads(run_python(["-m", "dspatch", "check", "--json"]).stdout)["patches"]


@unit
def test_every_subcommand_owns_its_usage_and_help():
    top = dspatch_command("--help")
    assert top.returncode == 0 and all(f"    {name}" in top.stdout for name in cli.COMMANDS), top.stdout
    for name in cli.COMMANDS:
        helped = dspatch_command(name, "--help")
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: dspatch {name} "), (name, helped.stdout)
        assert "[--check]" not in helped.stdout
    wrong = dspatch_command("check", "--jsn")
    assert wrong.returncode == 2 and wrong.stderr.startswith("usage: dspatch check "), wrong.stderr
    assert "unrecognized arguments: --jsn" in wrong.stderr and "[--check]" not in wrong.stderr
    no_module = dspatch_command("run", "-m")
    assert no_module.returncode == 2 and no_module.stderr.startswith("usage: dspatch run "), no_module.stderr
    typo = dspatch_command("explian")
    assert typo.returncode == 2 and "'explian' is not a command" in typo.stderr and "explain" in typo.stderr
    script = dspatch_command("train.py")
    assert script.returncode == 2 and "dspatch run train.py" in script.stderr


@unit
def test_ids_are_positional_where_that_reads_naturally():
    extra = dspatch_command("check", "extra-arg")
    assert extra.returncode == 2 and "'extra-arg' is an unknown patch id" in one_line(extra)
    rows = json.loads(dspatch_command("check", ID, "--json").stdout)["patches"]
    assert [row["id"] for row in rows] == [ID]
    both = json.loads(dspatch_command("check", "trl", "--only", ID, "--json").stdout)["patches"]
    assert {row["id"] for row in both} == {ID} | {p for p in registry.all_patches() if p.startswith("trl/")}
    verify = dspatch_command("verify", ID)  # the form docs/testing.md shows: nothing installed here, nothing ran
    assert verify.returncode == cli.NOTHING_RAN and "nothing to verify" in verify.stderr, verify


@unit
@pytest.mark.parametrize("variable,value,hint", [("DSPATCH", "bogus", None),
                                                 ("DSPATCH", "deepspeed/zero3-moduleid", "deepspeed/zero3-module-id"),
                                                 ("DSPATCH", ",,", None),
                                                 ("DSPATCH_DISABLE", "zero3-moduleid", "deepspeed/zero3-module-id")])
def test_a_bad_selection_is_one_line_and_exit_2_for_every_command(tmp_path, variable, value, hint):
    script = tmp_path / "train.py"
    script.write_text("print('SCRIPT RAN')\n")
    env = clean_env(**{"DSPATCH": "1", variable: value})
    commands = [["check"], ["check", "--json"], ["verify"], ["verify", "--only", ID], ["export", "--out", "out"],
                ["export", "--all", "--out", "out"], ["export", "--check-against", str(tmp_path)], ["explain", LOG],
                ["run", str(script)]]
    for args in commands:
        proc = dspatch_command(*args, env=env, cwd=str(tmp_path))
        line = one_line(proc)
        assert proc.returncode == 2 and f"{variable}={registry.short(value)}" in line, (args, line)
        assert "nothing is applied" in line and "SCRIPT RAN" not in proc.stdout, (args, line)
        if hint:
            assert f"(did you mean {hint}?)" in line, line
        assert not (tmp_path / "out").exists()
    for module in (["-m", "dspatch.export", "--out", "out"], ["-m", "dspatch.apply", "--check"]):
        proc = run_python(module, env=env, cwd=str(tmp_path), check=False)
        assert proc.returncode == 2 and f"{variable}=" in one_line(proc), proc.stderr


@unit
def test_an_unknown_id_given_on_the_command_line_names_the_closest():
    for args in (["check", "--only", "deepspeed/zero3-moduleid"], ["verify", "zero3-moduleid"],
                 ["run", "--only", "deepspeed/zero3-moduleid", "x.py"]):
        proc = dspatch_command(*args)
        assert proc.returncode == 2 and "(did you mean deepspeed/zero3-module-id?)" in one_line(proc), args


@unit
def test_dspatch_check_from_code_reports_a_bad_selection_instead_of_raising():
    code = ("import dspatch, json; rows = dspatch.check(); "
            "print(json.dumps(sorted({(r['verdict'], r['disabled_by']) for r in rows})))")
    for value in ("bogus", "deepspeed,nope"):
        seen = json.loads(run_python(["-c", code], env=clean_env(DSPATCH=value)).stdout)
        assert len(seen) == 1 and seen[0][0] == gating.DISABLED, seen
        assert "unknown patch id" in seen[0][1] and "nothing is applied" in seen[0][1]
    ids = run_python(["-c", "import dspatch; dspatch.check(['nope'])"], check=False)
    assert ids.returncode == 1 and "SelectionError" in ids.stderr  # ids in code: the caller's own mistake


def _fake_deepspeed(tmp_path):
    """A folder holding a package named deepspeed (empty): what the import hook watches, in the unit session."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    return str(tmp_path)


@unit
@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_strict_mode_stops_the_job_with_one_line(tmp_path, local_rank):
    """DSPATCH_STRICT=1 with a bad id fails the job (exit 1) at the first watched import: the message once, on every
    rank, and no traceback through the import machinery and dspatch's frames."""
    env = clean_env(PYTHONPATH=_fake_deepspeed(tmp_path), DSPATCH="nonexistent-id", DSPATCH_STRICT="1",
                    LOCAL_RANK=local_rank)
    proc = run_python(["-c", "import deepspeed; print('RAN ON')"], env=env, check=False)
    line = one_line(proc)
    assert proc.returncode == 1 and "RAN ON" not in proc.stdout
    assert line.startswith("dspatch: DSPATCH='nonexistent-id' is an unknown patch id") and "DSPATCH_STRICT=1" in line
    relaxed = run_python(["-c", "import deepspeed; print('RAN ON')"], env={**env, "DSPATCH_STRICT": "0"})
    assert relaxed.stdout.strip() == "RAN ON"
    if local_rank == "0":  # reported once per node, as everything dspatch says
        assert "Nothing applied" in one_line(relaxed)
    else:
        assert relaxed.stderr == ""


@unit
def test_a_typo_in_dspatch_disable_fails_closed_in_one_short_line(tmp_path):
    env = clean_env(PYTHONPATH=_fake_deepspeed(tmp_path), DSPATCH="1", DSPATCH_DISABLE="deepspeed/zero3-moduleid")
    proc = run_python(["-c", "import deepspeed"], env=env)
    line = one_line(proc)
    assert "(did you mean deepspeed/zero3-module-id?)" in line and "Nothing applied" in line


@unit
def test_check_json_gives_values():
    env = clean_env(DSPATCH="1", DSPATCH_DISABLE="trl")
    report = json.loads(dspatch_command("check", "--json", env=env).stdout)
    assert report["environment"] == {"DSPATCH": "1", "DSPATCH_DISABLE": "trl"}
    assert os.path.realpath(report["python"]) == os.path.realpath(sys.executable)


def _wide(text, columns=80):
    return [line for line in text.splitlines() if len(line) > columns]


@unit
def test_check_fits_80_columns_groups_and_sums_up():
    env = clean_env(COLUMNS="80")
    for args in (["check"], ["check", "-v"], ["check", "-v", "deepspeed", "trl"]):
        proc = dspatch_command(*args, env=env)
        assert proc.returncode == 0 and not _wide(proc.stdout), (args, _wide(proc.stdout))
    plain = dspatch_command("check", env=env).stdout
    total = len(registry.all_patches())
    assert f"0 of {total} apply here" in plain and "dspatch 0.1.0 for /" in plain
    assert "None of deepspeed, accelerate, transformers, trl is installed" in plain
    assert "  deepspeed: not installed (" in plain and "\x1b[" not in plain  # piped: no colour
    only = dspatch_command("check", "--only", ID, env=env).stdout
    assert ID.split("/")[1] in only and "not selected" not in only and "1 asked about" in only.replace("\n  ", " ")
    assert "zero3-module-id" not in only


def _rows(*verdicts):
    """check's rows for real patches with the verdicts given (what a stack would show), for rendering."""
    patches = list(registry.all_patches().values())
    rows = []
    for patch, verdict in zip(patches, verdicts):
        found = gating.Verdict(patch, verdict, "9.9.9", "source" if verdict == gating.APPLIES else "release",
                               patch.affected if verdict == gating.APPLIES else (patch.fixed_in or "1.0"))
        rows.append(gating.Row(patch, found))
    return rows


@unit
def test_check_shows_what_applies_first_then_the_rest_by_package_in_colour_on_a_terminal(monkeypatch):
    rows = _rows(gating.APPLIES, gating.FIXED_UPSTREAM, gating.APPLIES, gating.DRIFTED)
    monkeypatch.delenv("DSPATCH", raising=False)
    text = cli.check_text(rows, False, False, 80, colour=False)
    assert not _wide("\n".join(text))
    head = text.index("Apply here (2): these releases have the bug")
    assert text[head + 1].startswith(f"  {rows[0].patch.id}") and text[head + 2].startswith(f"  {rows[2].patch.id}")
    assert any(line.startswith("Need a look (1)") for line in text)
    assert "2 of 4 apply here; DSPATCH is not set, so none is applied (DSPATCH=1 applies them)" in \
        " ".join(" ".join(text).split())
    painted = "\n".join(cli.check_text(rows, False, False, 80, colour=True))
    assert "\x1b[31mdrifted\x1b[0m" in painted
    assert not _wide(painted.replace("\x1b[31m", "").replace("\x1b[0m", ""))


@unit
def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert term.colours(Tty()) and not term.colours(open(os.devnull, "w"))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not term.colours(Tty())


@unit
def test_wrapping_keeps_every_word_and_the_width():
    text = "a " * 50 + "x" * 130 + " end"
    lines = term.wrap(text, 40, "  > ", "    ")
    assert all(len(line) <= 40 for line in lines) and lines[0].startswith("  > a a")
    assert "".join(line.strip().replace("> ", "") for line in lines).replace(" ", "") == text.replace(" ", "")


@unit
def test_verify_with_nothing_to_run_says_so_and_exits_5():
    proc = dspatch_command("verify")
    assert proc.returncode == cli.NOTHING_RAN and "nothing to verify" in proc.stderr, proc
    assert sys.executable in proc.stderr
    legacy = run_python(["-m", "dspatch.apply", "--check", "--verify"], check=False)
    assert legacy.returncode == cli.NOTHING_RAN and "nothing to verify" in legacy.stderr


@unit
def test_verify_chooses_its_device():
    assert cli.device("cpu") == ("cpu", "cpu (--device cpu)")
    assert cli.device("auto", {"DS_ACCELERATOR": "cuda"})[0] == "cuda"
    assert cli.device("auto", {**os.environ, "DS_ACCELERATOR": ""})[0] in ("cpu", "cuda")


@unit
def test_export_refuses_a_folder_holding_other_patches_and_replaces_its_own(tmp_path):
    out = tmp_path / "prs"
    (out / "deepspeed").mkdir(parents=True)
    (out / "deepspeed" / "0001-mine.patch").write_text("not dspatch's\n")
    refused = dspatch_command("export", "--all", "--out", str(out))
    assert refused.returncode == 2 and "0001-mine.patch" in one_line(refused, out) and "new or empty" in refused.stderr
    (out / "deepspeed" / "0001-mine.patch").unlink()
    expected = sorted({path for p in registry.all_patches().values() for path in p.diffs.values()})
    for attempt in range(2):
        proc = dspatch_command("export", "--all", "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        assert ("replaced the" in proc.stdout) == bool(attempt)
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*.patch")) == expected


@unit
def test_explain_says_the_cause_first_and_what_fixes_the_job_where_the_log_came_from(tmp_path):
    """Here nothing is installed; the log (a real user's, with the `pip freeze` line a job prints added) shows a
    release the patch covers: DSPATCH fixes the job there."""
    body = [line for line in open(LOG, encoding="utf-8").read().splitlines() if not line.startswith("# ")]
    log = tmp_path / "job.log"
    log.write_text("accelerate==1.2.1\n" + "\n".join(body) + "\n")
    proc = dspatch_command("explain", str(log), env=clean_env(COLUMNS="80"))
    assert proc.returncode == 0 and not _wide(proc.stdout), proc
    patch = registry.all_patches()["accelerate/deepspeed-no-sync"]
    flat = " ".join(line.strip() for line in proc.stdout.splitlines())
    assert flat.startswith(f"{patch.cause} ({patch.id})")
    assert (f"do: the job ran accelerate 1.2.1 (printed in the log), which has this bug: DSPATCH={patch.id} (or "
            f"DSPATCH=1) on every rank fixes it there") in flat
    bugs = json.loads(dspatch_command("explain", str(log), "--json").stdout)["bugs"]
    assert bugs[0]["cause"] == patch.cause and bugs[0]["fix"] == patch.summary


@unit
def test_run_shows_the_users_traceback_as_python_does_and_runs_modules(tmp_path):
    (tmp_path / "helper.py").write_text("def boom():\n    raise ValueError('the user's own error')\n".replace(
        "user's", "users"))
    (tmp_path / "train.py").write_text("import helper\nhelper.boom()\n")
    (tmp_path / "job.py").write_text("import os, sys\nprint(os.environ['DSPATCH'], sys.argv[1:])\nsys.exit(3)\n")
    failed = dspatch_command("run", "train.py", cwd=str(tmp_path))
    plain = subprocess.run([sys.executable, "train.py"], cwd=str(tmp_path), capture_output=True, text=True)
    assert failed.returncode == plain.returncode == 1
    assert failed.stderr == plain.stderr, (failed.stderr, plain.stderr)
    module = dspatch_command("run", "-m", "job", "--lr", "1", cwd=str(tmp_path))
    assert module.returncode == 3 and module.stdout.strip() == "1 ['--lr', '1']", module
    only = dspatch_command("run", "--only", "deepspeed", "job.py", "-v", cwd=str(tmp_path))
    assert only.returncode == 3 and only.stdout.strip() == "deepspeed ['-v']", only
    missing = dspatch_command("run", "-m", "no_such_module_here", cwd=str(tmp_path))
    assert missing.returncode == 2 and "no module named no_such_module_here" in one_line(missing)


@unit
def test_audit_takes_constraints_as_pip_does(tmp_path):
    (tmp_path / "train.txt").write_text("deepspeed==0.16.9\n")
    (tmp_path / "constraints.txt").write_text("transformers==4.46.3\ntorch==2.6.0\n")
    proc = dspatch_command("audit", "train.txt", "-c", "constraints.txt", "--json", cwd=str(tmp_path))
    assert proc.returncode in (0, 1), proc.stderr
    assert {"deepspeed", "transformers", "torch"} <= set(json.loads(proc.stdout)["pins"])
    wide = dspatch_command("audit", "train.txt", "-c", "constraints.txt", "-v", cwd=str(tmp_path),
                           env=clean_env(COLUMNS="80"))
    assert not _wide(wide.stdout), _wide(wide.stdout)


# ---- on a stack: what needs a patch to apply ------------------------------------------------------------------------

@pytest.mark.stack
@pytest.mark.machinery
def test_verify_runs_where_asked_says_so_and_counts(tmp_path):
    proc = dspatch_command("verify", ID, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "verify: 1 patch on cpu (--device cpu)" in proc.stderr
    assert f"patch 1 of 1: {ID}: stock" in proc.stderr and f"patch 1 of 1: {ID}: patched" in proc.stderr
    assert "1 of 1 verified" in proc.stdout and "--verify" not in proc.stderr
    fixed = [pid for pid, p in registry.all_patches().items()
             if gating.evaluate(p).verdict in (gating.FIXED_UPSTREAM, gating.NOT_AFFECTED)]
    elsewhere = dspatch_command("verify", fixed[0])
    assert elsewhere.returncode == cli.NOTHING_RAN, elsewhere
    assert f"{fixed[0]}: " in elsewhere.stderr and "nothing to verify" in elsewhere.stderr


@pytest.mark.stack
@pytest.mark.machinery
def test_a_named_patch_that_does_not_apply_here_is_said_in_one_line():
    fixed = next(pid for pid, p in registry.all_patches().items()
                 if p.distribution == "deepspeed" and gating.evaluate(p).verdict == gating.NOT_AFFECTED)
    proc = run_python(["-c", "import deepspeed"], env=clean_env(DSPATCH=fixed))
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert said == [f"dspatch: DSPATCH names {fixed}, which does not apply here: not affected "
                    f"({gating.evaluate(registry.all_patches()[fixed]).reason})"], said


@pytest.mark.stack
@pytest.mark.machinery
def test_export_checks_against_site_packages_with_the_names_it_writes(tmp_path):
    import sysconfig

    rows = json.loads(dspatch_command("check", "--json").stdout)["patches"]
    expected = sorted({registry.all_patches()[r["id"]].diff_for(r["version"]) for r in rows
                       if r["verdict"] == gating.APPLIES} - {None})
    site = sysconfig.get_paths()["purelib"]
    proc = dspatch_command("export", "--out", str(tmp_path / "prs"), "--check-against", site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checked = sorted({line.split(": ")[1] for line in proc.stdout.splitlines() if ": applies" in line})
    assert checked == expected, (checked, expected)  # transformers' and accelerate's (src/ layout) included
    written = sorted(str(p.relative_to(tmp_path / "prs")) for p in (tmp_path / "prs").rglob("*.patch"))
    assert written == expected
