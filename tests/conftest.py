"""Test helpers. Tests marked `stack` need a real upstream stack (nox sessions old/mid/latest set
DSPATCH_TEST_STACK; there a missing package is a failure, not a skip). Tests marked `unit_only` run once,
in the torch-free unit session."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACK = os.environ.get("DSPATCH_TEST_STACK")


def pytest_collection_modifyitems(config, items):
    if STACK or importlib.util.find_spec("deepspeed") is not None:
        return
    skip = pytest.mark.skip(reason="needs a real upstream stack: run `nox -s old`, `mid` or `latest`")
    for item in items:
        if "stack" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _stack_is_complete():
    if STACK:
        for name in ("torch", "deepspeed"):
            assert importlib.util.find_spec(name), f"stack session {STACK!r} lacks {name}"


def clean_env(**extra):
    """This environment without any DSPATCH* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPATCH")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(args, env=None, check=True, timeout=900, cwd=None):
    """Run this interpreter in a neutral directory, so that it uses dspatch as installed, not the checkout."""
    proc = subprocess.run([sys.executable, *args], env=clean_env() if env is None else env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or tempfile.gettempdir())
    if check and proc.returncode != 0:
        raise AssertionError(f"python {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def last_json(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


_verified = {}


def verify(patch_id, env, *extra):
    """Run a patch's reproducers in a fresh interpreter: {"applied": [...], "results": {...}}. The same run on
    the installed stack asked for twice in a session (a patch's own test and the shared proofs) runs once."""
    if "PYTHONPATH" in env:  # a copy of upstream, which the test may change between runs: always run
        return last_json(run_python(["-m", "dspatch.verify", patch_id, *extra], env=env))
    key = (patch_id, tuple(sorted(env.items())), extra)
    if key not in _verified:
        _verified[key] = last_json(run_python(["-m", "dspatch.verify", patch_id, *extra], env=env))
    return json.loads(json.dumps(_verified[key]))  # a copy: callers may change it


def deepspeed_version():
    from dspatch.gating import installed_version

    return installed_version("deepspeed")


@pytest.fixture
def deepspeed_copy(tmp_path):
    """A private copy of the installed deepspeed package: (directory for PYTHONPATH, package dir)."""
    from dspatch.gating import module_file

    source = os.path.dirname(module_file("deepspeed"))
    site = tmp_path / "site"
    shutil.copytree(source, site / "deepspeed", ignore=shutil.ignore_patterns("__pycache__"))
    return str(site), str(site / "deepspeed")
