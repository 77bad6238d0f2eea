"""tools/new_patch.py: a new patch is one folder, which the registry finds as written and which fails until filled in."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env

pytestmark = pytest.mark.unit_only


def test_a_new_patch_is_one_folder_that_loads_and_fails_until_filled_in(tmp_path):
    for part in ("dspatch", "tools"):
        shutil.copytree(os.path.join(ROOT, part), tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__", "test_*.py", "logs", "conftest.py"))
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    made = subprocess.run([sys.executable, str(tmp_path / "tools" / "new_patch.py"), "deepspeed/some-new-bug"],
                          capture_output=True, text=True, env=clean_env())
    assert made.returncode == 0, made.stderr
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    folder = os.path.join("dspatch", "patches", "deepspeed", "some_new_bug")
    assert set(after) - set(before) == {folder, *(os.path.join(folder, f) for f in
                                                  ("__init__.py", "reproducers.py", "test_some_new_bug.py", "logs",
                                                   os.path.join("logs", ".keep")))}
    probe = ("import dspatch\n"
             "from dspatch import registry\n"
             "patch = registry.all_patches()['deepspeed/some-new-bug']\n"
             "print(len(registry.all_patches()), all(t.fingerprints for t in patch.targets), list(patch.expected_on_stock),\n"
             "      [row['verdict'] for row in dspatch.check() if row['id'] == patch.id])\n"
             "patch.scenarios['some_new_bug']()\n")
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(tmp_path),
                         env=clean_env(PYTHONPATH=str(tmp_path)))
    from dspatch import registry

    # found beside the others with nothing else edited; a placeholder target without fingerprints (the registry's
    # tests refuse it; no installed source matches it, so it never applies); its reproducer is not written yet, and
    # says so
    count, fingerprinted, scenarios, verdicts = ran.stdout.split("\n")[0].split(" ", 3)
    assert (int(count), fingerprinted, scenarios) == (len(registry.all_patches()) + 1, "False", "['some_new_bug']"), ran
    assert verdicts in ("['not installed']", "['drifted']"), ran
    assert "NotImplementedError: deepspeed/some-new-bug: write the reproducer" in ran.stderr, ran.stderr
    again = subprocess.run([sys.executable, str(tmp_path / "tools" / "new_patch.py"), "deepspeed/some-new-bug"],
                           capture_output=True, text=True, env=clean_env())
    assert again.returncode == 1 and "exists already" in again.stderr
    bad = subprocess.run([sys.executable, str(tmp_path / "tools" / "new_patch.py"), "DeepSpeed/Bad_Name"],
                         capture_output=True, text=True, env=clean_env())
    assert bad.returncode == 1 and "usage" in bad.stderr
