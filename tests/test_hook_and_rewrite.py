"""The import hook and the source rewrite on small packages made here: no upstream stack needed."""
import json
import textwrap
import zipfile

from conftest import run_python

HOOK_PROBE = r'''
import json, sys, importlib, importlib.util
sys.path.insert(0, sys.argv[1])
from dspatch._hook import PostImportFinder
seen = []
finder = PostImportFinder(seen.append, watched=("fakepkg",))
sys.meta_path.insert(0, finder)
for _ in range(50):  # libraries probe with find_spec all the time: nothing may pile up
    importlib.util.find_spec("fakepkg")
import copy, pickle
probe = importlib.util.find_spec("fakepkg.other")  # a spec nobody imports keeps the proxy loader
copy.deepcopy(probe); pickle.loads(pickle.dumps(probe.loader))  # no recursion
import fakepkg.sub, plain
mod = sys.modules["fakepkg.sub"]
print(json.dumps({"seen": seen, "loader": type(mod.__loader__).__name__,
                  "spec_loader": type(mod.__spec__.loader).__name__, "value": fakepkg.sub.VALUE}))
'''


def _fake_package(root):
    (root / "fakepkg").mkdir()
    (root / "fakepkg" / "__init__.py").write_text("from . import helper\n")
    (root / "fakepkg" / "helper.py").write_text("X = 1\n")
    (root / "fakepkg" / "sub.py").write_text("VALUE = 42\n")
    (root / "fakepkg" / "other.py").write_text("")
    (root / "plain.py").write_text("Y = 2\n")


def test_hook_notifies_once_per_watched_module_after_it_ran(tmp_path):
    _fake_package(tmp_path)
    out = json.loads(run_python(["-c", HOOK_PROBE, str(tmp_path)]).stdout)
    assert out["seen"] == ["fakepkg.helper", "fakepkg", "fakepkg.sub"]  # inner modules finish first
    assert out["loader"] == out["spec_loader"] == "SourceFileLoader"  # the module keeps its real loader
    assert out["value"] == 42


def test_hook_leaves_shared_zip_loaders_alone(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _fake_package(src)
    archive = tmp_path / "bundle.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for path in src.rglob("*.py"):
            z.write(path, path.relative_to(src).as_posix())
    out = json.loads(run_python(["-c", HOOK_PROBE, str(archive)]).stdout)
    assert out["seen"] == ["fakepkg.helper", "fakepkg", "fakepkg.sub"]  # once each; `plain` not watched
    assert out["loader"] == "zipimporter"


REWRITE_PROBE = r'''
import json, sys, types, importlib
sys.path.insert(0, sys.argv[1])
import target
from dspatch.spec import Target
from dspatch.rewrite import _the_function, rebuild, rename_attribute
original = vars(target.Box)["describe"]
fixed = rebuild(Target("target", "Box.describe", {}), rename_attribute("id", "ds_id"), original)
thing = types.SimpleNamespace(id="user", ds_id=7)
box = target.Box()
first, again = fixed(box, thing), fixed(box, thing)
new, old = (_the_function(f, "describe", target.__file__, "Box.describe") for f in (fixed, original))
print(json.dumps({"fixed": first, "again": again, "stock": original(box, thing),
                  "line": new is not old and new.__code__.co_firstlineno == old.__code__.co_firstlineno,
                  "annotation": new.__annotations__["return"], "decorated": getattr(fixed, "decorated", False)}))
'''

TARGET = '''
from __future__ import annotations
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from somewhere import Missing


def tag(function):
    def decorated(*args, **kwargs):  # no functools.wraps, like deepspeed's instrument_w_nvtx
        return function(*args, **kwargs)
    decorated.decorated = True
    return decorated


class Base:
    def describe(self, thing):
        return "base"


class Box(Base):
    KIND = "box"

    def __init__(self):
        self.__secret = "mangled"

    @tag
    def describe(self, thing, seen=[]) -> Missing:
        seen.append(1)
        text = """first line
col0 text"""
        return [super().describe(thing), __class__.KIND, self.__secret, thing.id, len(seen), text]

    def _helper(self):
        return 0
'''


def test_rewrite_changes_only_what_the_transform_changes(tmp_path):
    (tmp_path / "target.py").write_text(textwrap.dedent(TARGET))
    out = json.loads(run_python(["-c", REWRITE_PROBE, str(tmp_path)]).stdout)
    text = "first line\ncol0 text"
    assert out["stock"] == ["base", "box", "mangled", "user", 3, text]
    assert out["fixed"] == ["base", "box", "mangled", 7, 1, text]
    assert out["again"][4] == 2  # mutable default: the original's own list, shared with the copy
    assert out["line"] and out["decorated"] and out["annotation"] == "Missing"


def test_rewrite_refuses_class_body_names_in_decorators(tmp_path):
    (tmp_path / "target.py").write_text(textwrap.dedent('''
        class Box:
            @property
            def size(self):
                return self.id

            @size.setter
            def size(self, value):
                self.id = value
        '''))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import target\n"
            "from dspatch.spec import Target\n"
            "from dspatch.rewrite import RewriteError, rebuild, rename_attribute\n"
            "try:\n"
            "    rebuild(Target('target', 'Box.size', {}), rename_attribute('id', 'ds_id'), vars(target.Box)['size'])\n"
            "except RewriteError as e:\n"
            "    print('refused', e)\n")
    out = run_python(["-c", code, str(tmp_path)]).stdout
    assert out.startswith("refused Box.size: its decorators/defaults use class-body names ['size']")
