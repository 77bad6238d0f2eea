"""Reliability without a stack: property-based fuzzing of the four environment variables (hypothesis), and
--check on damaged installs. The stack half (numerics, revert, faults, threads) is test_reliability.py."""
import os

import pytest
from hypothesis import given, settings, strategies as st

from dspatch import _runtime, gating, registry, status

from conftest import clean_env, run_python

pytestmark = pytest.mark.unit_only

IDS = list(registry.all_patches())
# what people type: ids, prefixes, on/off words in any case, separators, typos, whitespace, unicode, long junk
TOKEN = st.one_of(st.sampled_from(IDS), st.sampled_from(["deepspeed", "trl", "accelerate/", "transformers", "1",
                                                         "ALL", "on", "0", "off", "None", "yes", "", " "]),
                  st.sampled_from(IDS).map(lambda s: s[:-1]), st.text(max_size=12))
VALUE = st.one_of(st.lists(TOKEN, max_size=4).flatmap(
    lambda ts: st.sampled_from([",", ";", ", ", " ,"]).map(lambda sep: sep.join(ts))),
    st.text(max_size=40), st.just("x" * 5000))
ENV = st.fixed_dictionaries({}, optional={"DSPATCH": VALUE, "DSPATCH_DISABLE": VALUE, "DSPATCH_STRICT": VALUE,
                                          "DSPATCH_VERBOSE": VALUE})


def _env(values):
    # a process environment cannot hold NUL, and the OS refuses lone surrogates
    return {k: v.replace("\x00", "").encode("utf-8", "replace").decode("utf-8") for k, v in values.items()}


@settings(max_examples=15, deadline=None)
@given(ENV)
def test_interpreter_start_never_fails(values):
    proc = run_python(["-c", "print('up')"], env=clean_env(**_env(values)), check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "up\n", ""), values


@settings(max_examples=15, deadline=None)
@given(ENV)
def test_check_says_a_bad_value_in_one_line(values):
    proc = run_python(["-m", "dspatch.apply", "--check"], env=clean_env(**_env(values)), check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    if proc.returncode == 2:
        assert len(lines) == 1 and lines[0].startswith("dspatch: DSPATCH") and "nothing is applied" in lines[0], lines
        # a huge value is cut, not echoed whole, and the known ids are not listed (`dspatch check` does)
        assert len(lines[0]) < 300, lines
    else:
        assert proc.returncode == 0 and lines == [], (values, lines)


@settings(max_examples=200, deadline=None)
@given(ENV)
def test_check_shows_the_selection_the_runtime_uses(values):
    env = _env(values)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(clean_env(**env))
    try:
        try:
            rows = status.check_all(environ=os.environ)
        except registry.SelectionError:
            rows = None
        said = []
        real_say, _runtime._say = _runtime._say, said.append
        try:
            chosen = _runtime.activate(None, False) if registry.active() else {}
        finally:
            _runtime._say = real_say
            _runtime.revert()
            _runtime.state.reported.clear()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if rows is None:  # --check refuses the value: the runtime applies nothing, and says why
        assert chosen == {} and said and "Nothing applied" in said[0], (values, said)
    else:
        shown = {row.patch.id for row in rows if row.verdict != gating.DISABLED} if registry.active(env) \
            else set()
        assert set(chosen) == shown, (values, chosen, shown)


def _fake_site(tmp_path, version="0.14.4", metadata=True, files=("__init__.py",)):
    """A deepspeed install damaged in one way: a real-looking dist-info, but only some files."""
    site = tmp_path / "site"
    package = site / "deepspeed"
    package.mkdir(parents=True)
    for name in files:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("")
    if metadata is not None:
        info = site / f"deepspeed-{version}.dist-info"
        info.mkdir()
        if metadata:
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
        else:
            (info / "METADATA").write_bytes(b"\xff\xfe garbage \x00")
        (info / "RECORD").write_text("")
    return str(site)


def _check(site, *args):
    proc = run_python(["-m", "dspatch.apply", "--check", "--json", *args], env=clean_env(PYTHONPATH=site),
                      check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    import json

    return proc.returncode, {row["id"]: row for row in json.loads(proc.stdout)["patches"]}


def test_check_on_an_install_missing_its_target_files_reports_them(tmp_path):
    rc, rows = _check(_fake_site(tmp_path))
    row = rows["deepspeed/frozen-param-names"]
    assert rc == 0 and row["verdict"] == gating.DRIFTED
    assert row["reason"] == "deepspeed.runtime.engine not found in the installed deepspeed; left out"
    assert _check(_fake_site(tmp_path / "again"), "--strict")[0] == 1


def test_check_on_unreadable_or_odd_metadata_reports_it(tmp_path):
    rc, rows = _check(_fake_site(tmp_path, metadata=False))
    assert rc == 0 and rows["deepspeed/frozen-param-names"]["verdict"] in (gating.BROKEN, gating.DRIFTED)
    rc, rows = _check(_fake_site(tmp_path / "odd", version="banana"))
    assert rc == 0 and rows["deepspeed/frozen-param-names"]["verdict"] == gating.DRIFTED
    assert "is not a PEP 440 version" in rows["deepspeed/frozen-param-names"]["reason"]


def test_check_on_a_target_file_that_is_not_python_reports_it(tmp_path):
    site = _fake_site(tmp_path, files=("__init__.py", "runtime/__init__.py", "runtime/engine.py"))
    with open(os.path.join(site, "deepspeed", "runtime", "engine.py"), "wb") as f:
        f.write(b"def broken(:\n\xff\xfe")
    rc, rows = _check(site)
    row = rows["deepspeed/frozen-param-names"]
    assert rc == 0 and row["verdict"] == gating.DRIFTED and "cannot read" in row["reason"], row
