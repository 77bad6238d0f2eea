"""The registry, selection rules and fingerprints: pure Python, no upstream package needed."""
import ast
import glob
import importlib
import os
import re

import pytest

from dspatch import data_dir, gating, registry
from dspatch import upstream
from dspatch.spec import Patch, Proof, Target
from dspatch.versions import Version

from conftest import ROOT


def test_every_patch_folder_is_registered_and_complete():
    """The registry is the folders: every folder under dspatch/patches/<package>/ with Python in it is a patch, with
    its fix and its reproducers (a folder missing one would otherwise be skipped without a word)."""
    patches = registry.all_patches()
    root = os.path.join(ROOT, "dspatch", "patches")
    folders = {os.path.relpath(os.path.dirname(path), root)
               for path in glob.glob(os.path.join(root, "*", "*", "*.py"))}
    assert folders == {f"{p.distribution}/{p.id.split('/', 1)[1].replace('-', '_')}" for p in patches.values()}
    for folder in folders:
        assert {"__init__.py", "reproducers.py"} <= set(os.listdir(os.path.join(root, folder))), folder
    for pid, patch in patches.items():
        assert isinstance(patch, Patch) and pid.startswith(patch.distribution + "/")
        assert patch.targets and all(t.fingerprints for t in patch.targets), pid
        assert patch.links and patch.summary and patch.affected
        assert set(patch.declared_on_stock) <= set(patch.scenarios) and patch.declared_on_stock
        assert patch.band_check in patch.scenarios
        for diff in patch.diffs.values():
            assert os.path.isfile(os.path.join(data_dir("upstream_prs"), diff)), diff


def test_every_patched_package_is_watched():
    """A patch whose modules live in a package the import hook does not watch would never apply (issue 51): the
    watched packages must cover every target's top-level package, and the harness's copy (tests/warm.py, which must
    not import dspatch) must equal the hook's."""
    from dspatch import _hook

    import warm

    tops = {module.partition(".")[0] for patch in registry.all_patches().values() for module in patch.modules}
    assert tops <= set(_hook.WATCHED), tops - set(_hook.WATCHED)
    assert set(warm.WATCHED) == set(_hook.WATCHED)


def test_every_reproducers_module_declares_one_proof():
    """The proof settings are one typed object (dspatch.spec.Proof), not names read back as strings: a module that
    still declares an old ALL_CAPS setting would have it ignored without a word."""
    old = {"SCENARIOS", "EXPECTED_ON_STOCK", "STOCK_FAILS_ON", "BAND_CHECK", "RELEASES_CHECKED",
           "OTHERS_WITH_AND_WITHOUT", "SILENT", "LOUD_ON", "NECESSITY_PROVEN_BY"}
    for pid, patch in registry.all_patches().items():
        module = importlib.import_module(patch.reproducers)
        assert isinstance(module.PROOF, Proof), pid
        assert not old & set(vars(module)), (pid, "an ALL_CAPS proof setting: declare it in PROOF")
        assert set(module.PROOF.stock_fails_on) <= set(module.PROOF.scenarios), pid
        first, last = patch.releases_checked or ("0", "0")
        assert Version(first) < Version(last), (pid, "releases_checked: its first and last release")
        if patch.others_with_and_without or patch.requires:  # each package it requires, with the bug's need and not
            assert all(set(v) == set(patch.requires) for v in patch.others_with_and_without or [{}]), pid
        if patch.necessity_proven_by:  # a test of the patch's own folder
            path, _, test = patch.necessity_proven_by.partition("::")
            own = os.path.join(os.path.dirname(module.__file__), path)
            assert f"def {test}(" in open(own).read(), (pid, patch.necessity_proven_by)


@pytest.mark.parametrize("value", ["1", "all", "ALL", "true", " yes "])
def test_all_words_select_everything(value):
    chosen, left_out = registry.selection(environ={"DSPATCH": value})
    assert chosen == list(registry.all_patches()) and not left_out


@pytest.mark.parametrize("value", ["", "0", "off", "false"])
def test_off_words_select_nothing(value):
    chosen, _ = registry.selection(environ={"DSPATCH": value})
    assert chosen == []


def test_ids_prefixes_and_disable():
    pid = "deepspeed/zero3-module-id"
    deepspeed_ids = [p for p in registry.all_patches() if p.startswith("deepspeed/")]
    assert registry.selection(environ={"DSPATCH": pid})[0] == [pid]
    assert registry.selection(environ={"DSPATCH": " deepspeed , "})[0] == deepspeed_ids
    chosen, left_out = registry.selection(environ={"DSPATCH": "1", "DSPATCH_DISABLE": pid})
    assert pid not in chosen and chosen == [p for p in registry.all_patches() if p != pid]
    assert "DSPATCH_DISABLE" in left_out[pid]
    assert registry.selection(ids=[pid], environ={})[0] == [pid]


@pytest.mark.parametrize("value,guess", [("deepspeed/zero3-moduleid", "deepspeed/zero3-module-id"), ("yes-please", None),
                                         ("deepspeed/zero3-module-id,bogus", None), ("zero3-modul-id",
                                                                                     "deepspeed/zero3-module-id"),
                                         ("deepspeed/zero3", "deepspeed/zero3-module-id")])
def test_unknown_ids_are_an_error_that_names_the_closest_one(value, guess):
    """One short line: the value, the unknown id, the id it most likely meant, where the ids are listed; never the
    list itself (it grows with every patch)."""
    with pytest.raises(registry.SelectionError) as e:
        registry.selection(environ={"DSPATCH": value})
    message = str(e.value)
    assert "unknown patch id" in message and len(message) < 200 and message.count("deepspeed/") <= 2, message
    assert (f"(did you mean {guess}?)" in message) if guess else "`dspatch check` lists the ids" in message, message
    with pytest.raises(registry.SelectionError):
        registry.selection(environ={"DSPATCH": "1", "DSPATCH_DISABLE": value.split(",")[-1] + "x"})


def test_fingerprint_ignores_formatting_but_not_code():
    base = ["    def f(self, x):", "        y = x.id", "        return y"]
    assert upstream.fingerprint_lines(base) == upstream.fingerprint_lines(
        ["def f(self, x):", "", "    # a comment", "    y = x.id   ", "    return y"])
    assert upstream.fingerprint_lines(base) != upstream.fingerprint_lines(
        ["def f(self, x):", "    y = x.ds_id", "    return y"])


FORMATTED = [
    # trailing comment, re-wrapped call, different indentation widths, other quotes, a split string
    ["def f(self, x):", "    y = g(x.id, 'a b')  # why", "    if y:", "        return y", "    return None"],
    ["def f(self, x):", "  y = g(", "      x.id,", "      \"a \" 'b'", "  )", "  if y:", "      return y",
     "  return None"],
    ["def f(self, x):", "    y = g(x.id, \\", "          'a b')", "    if y:", "     return y", "    return None"],
]


def test_fingerprint_is_blind_to_formatting_and_comments():
    assert len({upstream.fingerprint_lines(lines) for lines in FORMATTED}) == 1


@pytest.mark.parametrize("change", [
    ["def f(self, x):", "    y = g(x.ds_id, 'a b')", "    if y:", "        return y", "    return None"],
    ["def f(self, x):", "    y = g(x.id, 'a  b')", "    if y:", "        return y", "    return None"],
    # the same lines with the last statement moved into the block: code, not formatting
    ["def f(self, x):", "    y = g(x.id, 'a b')", "    if y:", "        return y", "        return None"],
    ["def f(self, x):", "    y = g(x.id, f'a b')", "    if y:", "        return y", "    return None"],
])
def test_fingerprint_sees_every_change_of_code(change):
    assert upstream.fingerprint_lines(change) != upstream.fingerprint_lines(FORMATTED[0])


def test_fingerprint_of_fstrings_is_their_text():
    one = ["def f(x):", "    return f'{x!r:>{3}} and {x.id}'  # note"]
    two = ["def f(x):", "        return f'{x!r:>{3}} and {x.id}'"]
    assert upstream.fingerprint_lines(one) == upstream.fingerprint_lines(two)
    assert upstream.code_tokens("\n".join(one) + "\n")[-2] == "sf'{x!r:>{3}} and {x.id}'"


def test_empty_and_oversized_selections_are_clear_errors():
    with pytest.raises(registry.SelectionError, match="names no patch"):
        registry.selection(environ={"DSPATCH": ",,"})
    with pytest.raises(registry.SelectionError, match="names no patch"):
        registry.selection(ids=[], environ={})
    huge = "x" * 100_000
    with pytest.raises(registry.SelectionError) as e:
        registry.selection(environ={"DSPATCH": huge})
    assert len(str(e.value)) < 200 and "(100000 characters)" in str(e.value)  # the value is cut
    assert registry.selection(environ={"DSPATCH": "1", "DSPATCH_DISABLE": ""})[0]  # empty disable: nothing


def test_source_segment_includes_decorators(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import x\n\nclass A:\n    @x.deco\n    def f(self):\n        return 1\n")
    first, lines = upstream.source_segment(str(path), "A.f")
    assert first == 4 and lines[0].strip() == "@x.deco" and upstream.source_segment(str(path), "A.g") is None


def _every_definition(tree):
    """Qualnames of every top-level definition and every definition directly in a top-level class."""
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, kinds):
            yield node.name
            if isinstance(node, ast.ClassDef):
                yield from (f"{node.name}.{child.name}" for child in node.body if isinstance(child, kinds))


def definitions_found_alike(folders, recursive=True):
    """Over every .py file below `folders` (or named there): the quick line-based lookup of each definition
    gives exactly what parsing the whole file gives, or nothing (then the whole file is parsed). Returns
    (quick, total) counts."""
    quick = total = 0
    for folder in folders:
        walk = os.walk(folder) if os.path.isdir(folder) else [(*os.path.split(folder)[:1], [], [folder])]
        for root, dirs, names in walk:
            dirs[:] = sorted(d for d in dirs if d != "site-packages") if recursive else []
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(root, name)
                try:
                    lines, tree = upstream._parse(path)
                except (SyntaxError, UnicodeDecodeError, ValueError):
                    continue
                index, ends = upstream._index(lines), {}
                for qualname in _every_definition(tree):
                    node = upstream.find_definition(tree, qualname)
                    if node is None:  # a method of a class bound again later: neither way finds it
                        assert upstream._quick_segment(lines, qualname, index, ends) is None, (path, qualname)
                        continue
                    first = upstream.first_line(node)
                    expected = (first, lines[first - 1:node.end_lineno])
                    got = upstream._quick_segment(lines, qualname, index, ends)
                    assert got in (None, expected), (path, qualname, got and got[0], expected[0])
                    if got is not None:  # and the node parsed from those lines alone is the whole file's
                        own = upstream.own_definition(path, qualname)
                        assert ast.dump(own, include_attributes=True) == ast.dump(node, include_attributes=True), \
                            (path, qualname)
                    quick += got is not None
                    total += 1
    return quick, total


@pytest.mark.unit_only  # the standard library is the same in every session
def test_quick_definition_lookup_agrees_with_a_full_parse_over_the_standard_library():
    quick, total = definitions_found_alike([os.path.dirname(ast.__file__)], recursive=False)  # its top level
    assert total > 5_000 and quick > 0.75 * total, (quick, total)  # it is the common path, and never wrong


@pytest.mark.stack
def test_quick_definition_lookup_agrees_with_a_full_parse_on_every_installed_target_file():
    files = {upstream.module_file(t.module) for patch in registry.all_patches().values() for t in patch.targets}
    quick, total = definitions_found_alike(sorted(f for f in files if f))
    assert total > 500 and quick > 0.75 * total, (quick, total)


def test_quick_definition_lookup_gives_up_where_lines_do_not_tell(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('class A(\n    object,\n):\n    def f(self):\n        return 1\n\n'
                    'def g():\n    x = """\ndef g():\n"""\n    return x\n\n'
                    'def h():\n    pass\ndef h():\n    return 2\n\n'
                    '@deco(\n1)\ndef k():\n    pass\n')
    lines = upstream._lines(str(path))[1]
    # a header over several lines: its closing bracket continues it
    assert upstream._quick_segment(lines, "A.f") == upstream.source_segment(str(path), "A.f") == \
        (4, ["    def f(self):", "        return 1"])
    assert upstream._quick_segment(lines, "g") is None  # the last 'def g' is inside a string: it does not parse
    assert upstream.source_segment(str(path), "g")[0] == 7
    assert upstream._quick_segment(lines, "h") == upstream.source_segment(str(path), "h") == (15, ["def h():",
                                                                                            "    return 2"])
    assert upstream._quick_segment(lines, "k") is None  # '1)' above could be a decorator's: parsed whole instead
    assert upstream.source_segment(str(path), "k") == (18, ["@deco(", "1)", "def k():", "    pass"])
    assert upstream._quick_segment(lines, "nope") is None and upstream.source_segment(str(path), "nope") is None


def test_quick_definition_lookup_past_statements_with_no_decorator_above(tmp_path):
    """A statement right above a definition is no decorator's unless a line starting with '@' stands above it
    (below the previous definition): then the definition's own lines tell."""
    path = tmp_path / "m.py"
    path.write_text("import x\ndist = None\n\ndef m():\n    return 3\n\n"
                    "class B:\n    @property\n    def p(self):\n        return 1\n    z = (\n        2\n    )\n\n"
                    "    def q(self):\n        return 2\n\n"
                    "    @x.deco(\n        1,\n    )\n    def r(self):\n        return 3\n")
    lines = upstream._lines(str(path))[1]
    assert upstream._quick_segment(lines, "m") == (4, ["def m():", "    return 3"])
    assert upstream._quick_segment(lines, "B.q") == (15, ["    def q(self):", "        return 2"])
    assert upstream._quick_segment(lines, "B.r") is None  # ')' above, and '@x.deco(' above it
    assert upstream.source_segment(str(path), "B.r")[0] == 18
    for qualname, line in (("m", 4), ("B.q", 15), ("B.p", 9)):
        tree = ast.parse(path.read_text())
        assert ast.dump(upstream.own_definition(str(path), qualname), include_attributes=True) == \
            ast.dump(upstream.find_definition(tree, qualname), include_attributes=True)
        assert upstream.own_definition(str(path), qualname).lineno == line
    assert upstream.own_definition(str(path), "B.r") is None


def test_patch_pages_and_tables_are_generated_from_the_registry():
    """The README's short table, docs/patches/README.md and one page per patch (docs/patches/<id>.md), nothing else
    under docs/patches: as `python -m dspatch.docs --write` writes them."""
    from dspatch import docs

    assert docs.stale(ROOT) == [], "generated pages are stale: run `python -m dspatch.docs --write`"
    pages = docs.expected(ROOT)
    for pid, patch in registry.all_patches().items():
        page = pages[docs.page_path(pid)]
        assert f"# {pid}\n" in page and patch.summary in page and patch.symptom
        assert all(path in page for path in patch.diffs.values())
        assert all(f"`{name}`" in page for name in patch.scenarios)
        assert f"]({pid}.md)" in pages["docs/patches/README.md"] and patch.cause in page


def test_the_readme_reads_in_a_minute_and_names_no_patch():
    """What dspatch is, how to install and use it, the two commands, the promises, what is proven where and a link
    per package to its patches: at most 12 KB, and no line that names a single patch (adding one leaves the README
    as it is; the generated index, docs/patches/README.md, holds the tables)."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(readme.encode()) <= 12 * 1024, len(readme.encode())
    for link in ("docs/patches/README.md", "docs/how-it-works.md", "docs/testing.md", "docs/explain.md",
                 "docs/benchmarks.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/audit.md"):
        assert f"({link})" in readme and os.path.exists(os.path.join(ROOT, link)), link
    named = [pid for pid in registry.all_patches() if pid in readme or pid.split("/", 1)[1] in readme]
    assert not named, named
    index = open(os.path.join(ROOT, "docs", "patches", "README.md"), encoding="utf-8").read()
    for package in {patch.distribution for patch in registry.all_patches().values()}:
        assert f"(docs/patches/README.md#{package})" in readme and f"\n## {package}\n" in index, package


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = readme.split("<!-- test-command -->\n", 1)[1].splitlines()[0].strip()
    assert command.endswith("python3 -m nox")
    assert "test-command" in open(os.path.join(ROOT, ".ci", "run")).read()


def import_cycles(graph):
    """The cycles of an import graph ({node: the nodes it imports}), one path from each node that starts one."""
    def cycle_from(start, path):
        for nxt in graph.get(path[-1], ()):
            if nxt == start:
                return path + [nxt]
            if nxt not in path:
                found = cycle_from(start, path + [nxt])
                if found:
                    return found
        return None

    return [c for c in (cycle_from(m, [m]) for m in graph) if c]


def test_dspatch_modules_import_each_other_one_way():
    """No cycle among dspatch's own modules, counting imports inside functions too: _hook at the bottom, _boot
    (the start-up entry) and the command-line modules at the top."""
    import ast
    import os

    import dspatch

    package = os.path.dirname(dspatch.__file__)
    graph = {}
    def sources(name):
        """The files of one of dspatch's modules; a subpackage (explain/, canary/) is one node of the graph."""
        path = os.path.join(package, name)
        if os.path.isdir(path):
            return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".py")]
        return [path] if name.endswith(".py") and name != "__init__.py" else []

    def exists(name):
        return os.path.exists(os.path.join(package, name + ".py")) or \
            os.path.exists(os.path.join(package, name, "__init__.py"))

    for name in sorted(os.listdir(package)):
        files = sources(name)
        if not files:
            continue
        module = name[:-3] if name.endswith(".py") else name
        # imports for the type checker alone (`if TYPE_CHECKING:`) never run: not an edge
        tree = ast.Module(body=[node for f in files for node in ast.parse(open(f).read()).body
                                if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                                        and node.test.id == "TYPE_CHECKING")], type_ignores=[])
        uses = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "dspatch":
                uses.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dspatch."):
                uses.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                uses.update(a.name.split(".")[1] for a in node.names if a.name.startswith("dspatch."))
        graph[module] = {u for u in uses if u != module and exists(u)}

    cycles = import_cycles(graph)
    assert not cycles, cycles
    assert graph["_hook"] == set() and graph["versions"] == set() and graph["_cache"] <= {"_hook"}, graph
    assert graph["upstream"] <= {"_hook", "_cache", "versions"}, graph  # reading what is installed
    assert graph["gating"] <= {"upstream", "_hook", "_cache", "versions"}, graph  # verdicts from it
    assert not any("_boot" in uses for uses in graph.values()), graph
    assert {"explain", "canary", "cli"} <= set(graph), graph  # the subpackages are read too


# ------------------------------------------------------------------------------------------------------------
# The framework extension: Target(..., releases=...) and Patch.targets_for / Patch.targets / gating.


def _moved_patch():
    return Patch(id="x/moved", summary="s", distribution="x", affected=">=1.0", fixed_in=None, apply=None,
                 targets=[Target("x.old", "f", {"a": "1.0"}, releases="<2.0"),
                          Target("x.new", "f", {"b": "2.0"}, releases=">=2.0"),
                          Target("x.common", "g", {"c": "1.0-2.0"})])


def _files(tmp_path, files):
    paths = {}
    for module, body in files.items():
        path = tmp_path / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        paths[module] = str(path)
    return paths.get


def test_banded_targets_by_release():
    patch = _moved_patch()
    names = lambda targets: [t.module for t in targets]  # noqa: E731
    assert names(patch.targets_for("1.5")) == ["x.old", "x.common"]
    assert names(patch.targets_for("2.0")) == names(patch.targets_for("2.1.dev0")) == ["x.new", "x.common"]
    assert names(patch.targets_for(None)) == ["x.old", "x.new", "x.common"]
    assert names(patch.targets_for("not-a-version")) == ["x.common"]
    # distribution "x" is not installed: every target (the gate says "not installed")
    assert names(patch.targets) == ["x.old", "x.new", "x.common"] and patch.modules == ("x.old", "x.new", "x.common")


def test_targets_without_releases_are_unchanged():
    patch = Patch(id="x/plain", summary="s", distribution="x", affected=">=0", fixed_in=None, apply=None,
                  targets=[Target("x.a", "f", {"a": "1"}), Target("x.b", "g", {"b": "1"})])
    assert patch.targets == patch.all_targets == patch.targets_for("1.0") == patch.targets_for(None)
    assert all(t.releases is None for t in patch.targets)


def test_a_release_is_gated_on_its_own_targets_only(tmp_path):
    patch = _moved_patch()
    fp = {}
    for name, body in (("old", "def f():\n    return 1\n"), ("new", "def f():\n    return 2\n"),
                       ("common", "def g():\n    return 3\n")):
        fp[name] = upstream.fingerprint_lines(body.splitlines())
    patch.all_targets[0].fingerprints = {fp["old"]: "1.0"}
    patch.all_targets[1].fingerprints = {fp["new"]: "2.0"}
    patch.all_targets[2].fingerprints = {fp["common"]: "1.0-2.0"}
    # an old release has no x.new, a new one no x.old: each is judged on what it has
    old = _files(tmp_path / "old", {"x.old": "def f():\n    return 1\n", "x.common": "def g():\n    return 3\n"})
    new = _files(tmp_path / "new", {"x.new": "def f():\n    return 2\n", "x.common": "def g():\n    return 3\n"})
    assert gating.evaluate(patch, version="1.5", locate=old).verdict == gating.APPLIES
    assert gating.evaluate(patch, version="2.0", locate=new).verdict == gating.APPLIES
    # a new release without the new module, or with other code there, is not one the patch knows
    found = gating.evaluate(patch, version="2.0", locate=old)
    verdict, reason = found.verdict, found.reason
    assert verdict == gating.DRIFTED and reason.startswith("x.new not found"), reason
    drifted = _files(tmp_path / "drift", {"x.new": "def f():\n    return 20\n", "x.common": "def g():\n    return 3\n"})
    found = gating.evaluate(patch, version="2.0", locate=drifted)
    verdict, reason = found.verdict, found.reason
    assert verdict == gating.DRIFTED and "x.new:f differs" in reason, reason


def test_a_release_with_no_target_is_never_patched(tmp_path):
    patch = Patch(id="x/gone", summary="s", distribution="x", affected=">=0", fixed_in=None, apply=None,
                  targets=[Target("x.old", "f", {"a": "1.0"}, releases="<2.0")])
    found = gating.evaluate(patch, version="2.0", locate=lambda module: None)
    verdict, reason = found.verdict, found.reason
    assert verdict == gating.DRIFTED and "no code of x 2.0 is known to this patch" in reason, reason


def test_installed_versions_are_importlib_metadatas():
    """gating reads `Version:` from dist-info directly (importlib.metadata's import costs more than the rest of
    --check): the same answer for every distribution installed here, and for an absent one."""
    import importlib.metadata

    names = {dist.metadata["Name"] for dist in importlib.metadata.distributions()}
    assert len(names) > 5
    for name in names:
        assert upstream._version_from_dist_info(name) == importlib.metadata.version(name), name
    assert upstream._version_from_dist_info("surely-not-installed-dspatch-test") is None


def test_verdicts_are_records_and_check_reads_their_fields(tmp_path):
    """evaluate returns a record (verdict, distribution, version, the rule and bound that decided, what was seen);
    `--check`'s short column and its JSON read the fields: rewording a reason cannot change them."""
    from dspatch import status

    body = "def f():\n    return 1\n"
    patch = Patch(id="x/needs", summary="s", distribution="x", affected=">=1.0,<2.0", fixed_in="2.0", apply=None,
                  supported=">=1.0,<1.9", requires={"torch": ">=2.6"},
                  targets=[Target("x.a", "f", {upstream.fingerprint_lines(body.splitlines()): "1.0"})])
    locate = _files(tmp_path / "t", {"x.a": body})
    cases = {  # version, others -> (verdict, rule, bound, seen, short column)
        ("1.5", "2.6.0"): (gating.APPLIES, "source", ">=1.0,<2.0", {"torch": "2.6.0"},
                           "fixed upstream in 2.0, with torch 2.6.0"),
        ("1.5", "2.5.1"): (gating.NOT_AFFECTED, "requires", "torch>=2.6", {"torch": "2.5.1"},
                           "needs torch>=2.6 (2.5.1 here)"),
        ("1.5", None): (gating.NOT_AFFECTED, "requires", "torch>=2.6", {"torch": None}, "needs torch>=2.6 (none here)"),
        ("2.1", "2.6.0"): (gating.FIXED_UPSTREAM, "release", "2.0", {}, "fixed in 2.0"),
        ("0.9", "2.6.0"): (gating.NOT_AFFECTED, "range", ">=1.0,<2.0", {}, "the bug is in >=1.0,<2.0"),
        ("1.9.1", "2.6.0"): (gating.UNSUPPORTED, "supported", ">=1.0,<1.9", {}, "written for >=1.0,<1.9 only"),
    }
    for (version, torch), (verdict, rule, bound, seen, short) in cases.items():
        found = gating.evaluate(patch, version=version, locate=locate, others={"torch": torch})
        assert (found.verdict, found.distribution, found.version, found.rule, found.bound, found.seen) == \
            (verdict, "x", version, rule, bound, seen), found
        assert status.brief(gating.Row(patch, found)) == short, found
        assert gating.Row(patch, found).as_dict()["found"] == found.as_dict() and found.as_dict()["reason"]
    drifted = gating.evaluate(patch, version="1.5", locate=_files(tmp_path / "d", {"x.a": "def f():\n    return 2\n"}),
                              others={"torch": "2.6.0"})
    assert drifted.verdict == gating.DRIFTED and drifted.rule == "source" and "x.a:f differs" in drifted.mismatch
    assert status.brief(gating.Row(patch, drifted)).startswith("x.a:f differs")
    off = gating.Row(patch, drifted, gating.DISABLED, "disabled by DSPATCH_DISABLE (...)", "disabled by DSPATCH_DISABLE")
    assert status.brief(off) == "disabled by DSPATCH_DISABLE"


def test_the_patches_imports_are_plain_imports_of_files():
    """The import graph between patches, drawn from the code: every `dspatch.patches...` a patch's module imports is a
    file of the package as laid out (no path extension or registry lookup in between, so mypy and other readers
    follow it), and no two patches import each other round."""
    root = os.path.join(ROOT, "dspatch", "patches")
    graph = {}
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        if os.path.basename(path).startswith(("test_", "conftest")):
            continue
        here = os.path.relpath(os.path.dirname(path), root).replace(os.sep, "/")
        for node in ast.walk(ast.parse(open(path).read())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if not name.startswith("dspatch.patches."):
                    continue
                parts = name.split(".")[2:]
                base = os.path.join(root, *parts)
                assert os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py")), (path, name)
                target = "/".join(parts[:2]) if len(parts) >= 2 else parts[0]
                if target != here:
                    graph.setdefault(here, set()).add(target)

    assert sum(map(len, graph.values())) >= 5, graph  # the patches do share code (fewer as dspatch.canary serves them)
    assert not import_cycles(graph), graph


def test_the_sessions_a_patch_names_are_the_noxfiles():
    """A patch chooses the sessions outside the matrix that prove it (Proof.proven_in, own_tests_in): each it names is
    one of the noxfile's proving sessions, and each of those is named by a patch (one named by none would stop)."""
    sessions = set(re.findall(r'proving_session\("(\w+)"', open(os.path.join(ROOT, "noxfile.py")).read()))
    named = {name for patch in registry.all_patches().values() for name in (*patch.proven_in, *patch.own_tests_in)}
    assert sessions and named == sessions, (named, sessions)
