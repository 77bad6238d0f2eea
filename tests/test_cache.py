"""dspatch's cache of what it computes from upstream files (dspatch/_cache.py): found only by everything it was
computed from, never a wrong value, never an error. Each probe runs in a fresh interpreter (nothing remembered
in-process), with the cache in a folder of the test's own (XDG_CACHE_HOME)."""
import json
import os

import pytest

from conftest import clean_env, run_python

pytestmark = pytest.mark.unit_only

TARGET = '''import functools


def deco(f):
    @functools.wraps(f)
    def inner(*a, **k):
        return f(*a, **k)
    return inner


class Engine:
    @deco
    def step(self, x):
        """One step."""
        return self.rate * x + 1
'''

TRANSFORM = '''import ast


def double(definition):
    for node in ast.walk(definition):
        if isinstance(node, ast.Constant) and node.value == 1:
            node.value = 2
'''

# fingerprint, rebuilt code and what the rebuilt code computes, and which cache files exist afterwards
PROBE = r'''
import json, os, sys
sys.dont_write_bytecode = True  # Python's own bytecode cache would serve the same-size, same-mtime edit stale
sys.path.insert(0, sys.argv[1])
import target, transform
from dspatch import gating, rewrite
from dspatch import upstream
from dspatch.spec import Target
t = Target("target", "Engine.step", {})
fn = rewrite.upstream_function(vars(target.Engine)["step"], t, target.__file__)
code = rewrite.rebuild_code(t, transform.double, fn)
fn.__code__ = code
engine = target.Engine(); engine.rate = 3
def describe(c):  # what the code is (marshal's own bytes differ with string interning)
    consts = [describe(k) if hasattr(k, "co_code") else repr(k) for k in c.co_consts]
    return [c.co_code.hex(), c.co_names, c.co_varnames, c.co_freevars, consts, c.co_firstlineno,
            c.co_linetable.hex(), c.co_exceptiontable.hex(), c.co_qualname, c.co_filename, c.co_flags]
folder = os.path.join(os.environ["XDG_CACHE_HOME"], "dspatch", "computed")
report = {"fingerprint": upstream.fingerprint(target.__file__, "Engine.step"), "code": describe(code),
          "result": engine.step(5)}
report["files"] = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs) if os.path.isdir(folder) else []
print("R " + json.dumps(report))
'''


def _probe(tmp_path, **env):
    env.setdefault("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proc = run_python(["-c", PROBE, str(tmp_path / "src")], env=clean_env(**env))
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])


@pytest.fixture
def sources(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "target.py").write_text(TARGET)
    (tmp_path / "src" / "transform.py").write_text(TRANSFORM)
    return tmp_path / "src"


def test_the_same_answers_with_and_without_the_cache(tmp_path, sources):
    off = _probe(tmp_path, DSPATCH_CACHE="0")
    assert off["files"] == [] and off["result"] == 17  # 3 * 5 + 2: the transform ran
    cold = _probe(tmp_path)
    assert cold["files"], "nothing was stored"
    warm = _probe(tmp_path)
    assert off["fingerprint"] == cold["fingerprint"] == warm["fingerprint"]
    assert off["code"] == cold["code"] == warm["code"] and warm["result"] == 17
    assert cold["files"] == warm["files"]  # the second run read, it computed nothing new


def test_an_edited_file_is_never_served_from_the_cache_even_with_the_same_size_and_mtime(tmp_path, sources):
    first = _probe(tmp_path)
    path = sources / "target.py"
    stat = os.stat(path)
    edited = TARGET.replace("self.rate * x + 1", "self.rate + x + 1")
    assert len(edited) == len(TARGET)
    path.write_text(edited)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns
    second = _probe(tmp_path)
    assert second["fingerprint"] != first["fingerprint"] and second["code"] != first["code"]
    assert second["result"] == 3 + 5 + 2  # the edited source, rebuilt
    assert second["fingerprint"] == _probe(tmp_path, DSPATCH_CACHE="0")["fingerprint"]


def test_a_change_to_the_transform_is_a_new_entry(tmp_path, sources):
    first = _probe(tmp_path)
    (sources / "transform.py").write_text(TRANSFORM.replace("node.value = 2", "node.value = 4"))
    second = _probe(tmp_path)
    assert second["fingerprint"] == first["fingerprint"] and second["result"] == 19


@pytest.mark.parametrize("damage", ["truncated", "garbage", "another key's", "empty"])
def test_a_damaged_entry_is_ignored_and_computed_again(tmp_path, sources, damage):
    first = _probe(tmp_path)
    for path in first["files"]:
        data = open(path, "rb").read()
        if damage == "truncated":
            data = data[:len(data) // 2]
        elif damage == "garbage":
            data = data[:40] + os.urandom(64)
        elif damage == "another key's":
            data = data.replace(b"Engine.step", b"Engine.stop")
        else:
            data = b""
        open(path, "wb").write(data)
    again = _probe(tmp_path)
    assert (again["fingerprint"], again["code"], again["result"]) == (first["fingerprint"], first["code"], 17)


def test_an_unwritable_cache_is_a_quiet_fallback(tmp_path, sources):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    for env in ({"XDG_CACHE_HOME": str(blocked)}, {"XDG_CACHE_HOME": "/proc/no-such-place"}):
        proc = run_python(["-c", PROBE, str(sources)], env=clean_env(**env))
        report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
        assert report["result"] == 17 and proc.stderr == ""
