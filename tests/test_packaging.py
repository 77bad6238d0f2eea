"""The wheel and the editable install: DSPATCH=1 activates in a new interpreter; uninstall leaves nothing."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env

pytestmark = pytest.mark.unit_only


def _venv(path):
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return str(path / "bin" / "python")


def _pip(python, *args):
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True,
                   env=clean_env())


def _site_entries(python):
    code = "import sysconfig, os; p = sysconfig.get_paths()['purelib']; print(sorted(os.listdir(p)))"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    return [e for e in eval(out) if "dspatch" in e.lower() or e == "patches"]


def _activation(python):
    code = "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('dspatch'))))"
    run = lambda env: json.loads(subprocess.run([python, "-c", code], env=env, check=True, capture_output=True,
                                                text=True, cwd="/").stdout)
    return run(clean_env()), run(clean_env(DSPATCH="1"))


def _check_json(python):
    out = subprocess.run([python, "-m", "dspatch.apply", "--check", "--json"], env=clean_env(), check=True,
                         capture_output=True, text=True, cwd="/").stdout
    return json.loads(out)


def _uninstall(python):
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "dspatch"], check=True, env=clean_env())


def test_wheel_install_activate_uninstall(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), ROOT], check=True,
                   env=clean_env())
    wheel = next(dist.glob("dspatch-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "dspatch.pth" in names and "dspatch/patches/deepspeed/zero3_module_id/__init__.py" in names
    assert "dspatch/patches/deepspeed/zero3_module_id/reproducers.py" in names
    assert not [n for n in names if n.startswith(("patches/", "tests/", "upstream_prs/"))]
    # a patch's own tests and logs, and their fixtures, stay in the repository
    assert not [n for n in names if os.path.basename(n).startswith(("test_", "conftest")) or "/logs/" in n]
    assert any(n.startswith("dspatch/upstream_prs/deepspeed/0001-") for n in names)
    python = _venv(tmp_path / "venv")
    _pip(python, str(wheel))
    assert sorted(_site_entries(python))[:2] == ["dspatch", "dspatch-0.1.0.dist-info"]
    assert "dspatch.pth" in _site_entries(python)
    assert _activation(python) == ([], ["dspatch", "dspatch._boot", "dspatch._hook"])
    report = _check_json(python)
    assert report["patches"][0]["verdict"] == "not installed"
    _console_script_runs_each_command(python, tmp_path)
    _uninstall(python)
    assert _site_entries(python) == []


def test_editable_install_activate_uninstall(tmp_path):
    python = _venv(tmp_path / "venv")
    _pip(python, "-e", ROOT)
    assert _activation(python) == ([], ["dspatch", "dspatch._boot", "dspatch._hook"])
    code = "import dspatch.patches.deepspeed.zero3_module_id as m, os; print(m.__file__)"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, cwd="/").stdout
    assert out.strip() == os.path.join(ROOT, "dspatch", "patches", "deepspeed", "zero3_module_id", "__init__.py")
    assert "deepspeed/zero3-module-id" in [row["id"] for row in _check_json(python)["patches"]]
    _uninstall(python)
    assert _site_entries(python) == []


def _console_script_runs_each_command(python, tmp_path):
    """The installed `dspatch` command: --help lists the commands; check, verify, explain, export and run each do
    their job; a script calling dspatch.apply() runs under `dspatch run` (`dspatch script.py` says to use that)."""
    command = os.path.join(os.path.dirname(python), "dspatch")

    def dspatch(*args, stdin=None):
        return subprocess.run([command, *args], env=clean_env(), capture_output=True, text=True, cwd=str(tmp_path),
                              input=stdin)

    usage = dspatch("--help")
    assert usage.returncode == 0 and all(f"    {name}" in usage.stdout for name in
                                         ("check", "verify", "explain", "export", "run", "audit")), usage.stdout
    assert json.loads(dspatch("check", "--json").stdout)["patches"][0]["verdict"] == "not installed"
    assert dspatch().stdout == dspatch("check").stdout != ""
    verify = dspatch("verify")  # nothing applies without the packages: nothing ran, and it says so
    assert verify.returncode == 5 and "nothing to verify" in verify.stderr, verify
    log = "AssertionError: no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage 2\n"
    explained = dspatch("explain", "-", "--json", stdin=log)
    assert explained.returncode == 0, explained
    assert [bug["id"] for bug in json.loads(explained.stdout)["bugs"]] == ["accelerate/deepspeed-no-sync"]
    exported = dspatch("export", "--out", str(tmp_path / "prs"))
    assert exported.returncode == 1 and "no diff" in (exported.stdout + exported.stderr).lower(), exported
    assert dspatch("export", "--out", str(tmp_path / "all"), "--all").returncode == 0
    assert list((tmp_path / "all").glob("deepspeed/*.patch"))
    script = tmp_path / "train.py"
    script.write_text("import os, sys, dspatch\nprint(os.environ['DSPATCH'], sorted(dspatch.apply(['deepspeed'])), "
                      "sys.argv[1:])\n")
    ran = dspatch("run", str(script), "--lr", "1")
    assert ran.returncode == 0, ran
    assert ran.stdout.startswith("1 ['deepspeed/") and ran.stdout.rstrip().endswith("['--lr', '1']"), ran.stdout
    old_form = dspatch(str(script), "--lr", "1")  # the first releases' `dspatch script.py`: pointed to `run`
    assert old_form.returncode == 2 and f"dspatch run {script}" in old_form.stderr, old_form
    unknown = dspatch("explian")
    assert unknown.returncode == 2 and "not a command" in unknown.stderr and "explain" in unknown.stderr
