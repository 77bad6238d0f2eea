"""What dspatch.pth does at interpreter start, and how activation behaves on a real stack. The stack's runs start from
a zygote that imported torch alone (tests/warm.py, mode "base"): dspatch.pth runs at the child's start and the child
imports every watched package itself, as a fresh interpreter does; what is read at start-up is read in fresh ones."""
import json

import pytest

from conftest import clean_env, deepspeed_version, run_python

LOADED = "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in " \
         "('dspatch', 'wrapt', 'packaging', 'torch', 'deepspeed'))))"


def _loaded(env):
    return json.loads(run_python(["-c", LOADED], env=env).stdout.strip().splitlines()[-1])


def test_unset_reads_the_environment_and_nothing_else():
    assert _loaded(clean_env()) == []
    for word in ("0", "off", "False", " no ", "none"):
        assert _loaded(clean_env(DSPATCH=word)) == [], word


def test_the_pth_and_the_one_reading_of_on_and_off_agree_on_off_words():
    import ast
    import os
    import re
    import sysconfig

    from dspatch import _hook

    line = open(os.path.join(sysconfig.get_paths()["purelib"], "dspatch.pth")).read()  # the installed one
    words = ast.literal_eval(re.search(r"not in (\(.*?\))", line).group(1))
    assert set(words) == set(_hook.OFF_WORDS)  # what dspatch._hook.flag reads (DSPATCH, DSPATCH_STRICT, ...)


def test_set_installs_only_the_tiny_hook():
    # no wrapt, no packaging, no patch machinery until a watched package is imported
    assert _loaded(clean_env(DSPATCH="1")) == ["dspatch", "dspatch._boot", "dspatch._hook"]


@pytest.mark.stack
@pytest.mark.machinery
def test_first_target_import_loads_and_applies():
    # one interpreter, as a job starts: its import of deepspeed loads dspatch's runtime, applies, and says so once
    code = ("import deepspeed, json, sys, dspatch._runtime as r; print(json.dumps([sorted(sys.modules), "
            "str(r.state_of('deepspeed/zero3-module-id'))]))")
    proc = run_python(["-c", code], env=clean_env(DSPATCH="1"), warm="base")
    loaded, state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "dspatch._runtime" in loaded and "deepspeed" in loaded
    from packaging.version import Version

    if Version(deepspeed_version()) <= Version("0.16.3"):
        assert state.startswith("('applied'"), state
    else:
        assert state.startswith("('fixed upstream'"), state
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert len(said) == 1 and said[0].startswith("dspatch: applied "), said  # quiet: one line for the import


@pytest.mark.stack
@pytest.mark.machinery
def test_other_watched_packages_import_normally_with_the_hook():
    code = "import transformers, accelerate, trl, deepspeed; print('fine')"
    assert run_python(["-c", code], env=clean_env(DSPATCH="1"), warm="base").stdout.strip().endswith("fine")


@pytest.mark.stack
@pytest.mark.machinery
def test_unknown_id_in_dspatch_is_reported_and_the_import_goes_on():
    proc = run_python(["-c", "import deepspeed; print('imported')"], env=clean_env(DSPATCH="deepspeed/nope"), warm="base")
    assert proc.stdout.strip().endswith("imported")
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert len(said) == 1 and "DSPATCH='deepspeed/nope' is an unknown patch id" in said[0] and len(said[0]) < 200
    strict = run_python(["-c", "import deepspeed"], env=clean_env(DSPATCH="deepspeed/nope", DSPATCH_STRICT="1"),
                        check=False, warm="base")
    # the job stops, with the reason once and no traceback through the import machinery
    assert strict.returncode == 1 and strict.stderr.startswith("dspatch: DSPATCH='deepspeed/nope' is an unknown patch id")
    assert strict.stderr.count("unknown patch id") == 1 and "Traceback" not in strict.stderr, strict.stderr


@pytest.mark.stack
@pytest.mark.machinery
def test_local_rank_other_than_zero_is_quiet():
    # a fresh interpreter: in a zygote, an environment of its own would start one for this run alone
    proc = run_python(["-c", "import deepspeed"], env=clean_env(DSPATCH="1", LOCAL_RANK="1"))
    assert not [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]


@pytest.mark.stack
@pytest.mark.machinery
def test_an_internal_dspatch_error_never_breaks_the_import():
    code = ("import dspatch._runtime as r\n"
            "def broken(name): raise ZeroDivisionError('simulated dspatch bug')\n"
            "r.module_loaded = broken\n"
            "import deepspeed; print('imported')")
    proc = run_python(["-c", code], env=clean_env(DSPATCH="1"), warm="base")
    assert proc.stdout.strip().endswith("imported")
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert len(said) == 1 and "internal error" in said[0] and "simulated dspatch bug" in said[0]
    strict = run_python(["-c", code], env=clean_env(DSPATCH="1", DSPATCH_STRICT="1"), check=False, warm="base")
    assert strict.returncode != 0 and "simulated dspatch bug" in strict.stderr


def test_dspatch_1_at_start_up_imports_nothing_beyond_the_hook():
    """What DSPATCH=1 may load at start-up: dspatch and its hook, nothing they drag in (threading: ~5 ms)."""
    code = "import sys, json; print(json.dumps(sorted(sys.modules)))"
    before = set(json.loads(run_python(["-c", code], env=clean_env()).stdout))
    after = set(json.loads(run_python(["-c", code], env=clean_env(DSPATCH="1")).stdout))
    assert after - before == {"dspatch", "dspatch._boot", "dspatch._hook"}, after - before
