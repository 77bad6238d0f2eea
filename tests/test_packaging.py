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
    assert "dspatch.pth" in names and "dspatch/patches/deepspeed/zero3_module_id.py" in names
    assert not [n for n in names if n.startswith(("patches/", "tests/", "upstream_prs/"))]
    assert any(n.startswith("dspatch/upstream_prs/deepspeed/0001-") for n in names)
    python = _venv(tmp_path / "venv")
    _pip(python, str(wheel))
    assert sorted(_site_entries(python))[:2] == ["dspatch", "dspatch-0.1.0.dist-info"]
    assert "dspatch.pth" in _site_entries(python)
    assert _activation(python) == ([], ["dspatch", "dspatch._boot", "dspatch._hook"])
    report = _check_json(python)
    assert report["patches"][0]["verdict"] == "not installed"
    _uninstall(python)
    assert _site_entries(python) == []


def test_editable_install_activate_uninstall(tmp_path):
    python = _venv(tmp_path / "venv")
    _pip(python, "-e", ROOT)
    assert _activation(python) == ([], ["dspatch", "dspatch._boot", "dspatch._hook"])
    code = "import dspatch.patches.deepspeed.zero3_module_id as m, os; print(m.__file__)"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, cwd="/").stdout
    assert out.strip() == os.path.join(ROOT, "patches", "deepspeed", "zero3_module_id.py")
    assert _check_json(python)["patches"][0]["id"] == "deepspeed/zero3-module-id"
    _uninstall(python)
    assert _site_entries(python) == []
