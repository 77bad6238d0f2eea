"""Gating verdicts against every released deepspeed 0.14.0-0.19.8 (sdists from PyPI, nothing executed), and
every upstream diff against every release of its band."""
import os
import subprocess

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dspatch import data_dir, gating, registry

from upstream_releases import extract_modules, released_fingerprints, sdist_versions

pytestmark = pytest.mark.unit_only

PATCH = registry.all_patches()["deepspeed/zero3-module-id"]
RELEASES = sdist_versions("deepspeed", "0.14.0", "0.19.8")


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.14.0" and RELEASES[-1] == "0.19.8" and len(RELEASES) >= 45
    assert "0.16.3" in RELEASES and "0.16.4" in RELEASES


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_for_release(version, tmp_path):
    locate = extract_modules("deepspeed", version, PATCH.modules, str(tmp_path))
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    if Version(version) <= Version("0.16.3"):
        assert verdict == gating.APPLIES, reason
        diff = PATCH.diff_for(version)
        assert diff, f"no upstream diff for {version}"
        subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), diff)], cwd=tmp_path,
                       check=True)
    else:
        assert verdict == gating.FIXED_UPSTREAM, reason


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    """No stale entries: each accepted fingerprint is the source of at least one affected release."""
    seen = released_fingerprints(PATCH, [v for v in RELEASES if Version(v) <= Version("0.16.3")], tmp_path)
    for t in PATCH.targets:
        assert set(t.fingerprints) == seen[t.qualname], t


def test_versions_outside_the_written_range():
    def verdict(version):
        return gating.evaluate(PATCH, version=version, locate=lambda m: None)[1]

    assert verdict("0.13.5") == gating.UNSUPPORTED
    assert verdict("0.16.4") == gating.FIXED_UPSTREAM and verdict("1.0.0") == gating.FIXED_UPSTREAM
    assert verdict("0.16.3+cu121") == gating.DRIFTED  # in range, but its files could not be found here
    assert verdict("not-a-version") == gating.DRIFTED


@pytest.mark.parametrize("version, files, expected", [
    ("0.16.3+cu121", "0.16.3", gating.APPLIES),     # a local build of a release: its source decides
    ("0.16.4+g1234", "0.16.3", gating.APPLIES),     # git build after 0.16.3 (version.txt bumped), before the fix
    ("0.16.4+g5678", "0.16.4", gating.FIXED_UPSTREAM),  # git build with the fix
    ("0.16.4.dev0", "0.16.4", gating.FIXED_UPSTREAM),
    ("0.16.3.post1", "0.16.3", gating.APPLIES),
    ("0.16.3.post1", "0.16.4", gating.FIXED_UPSTREAM),  # says 0.16.3, has upstream's fix backported
    ("0.16.4+g9999", "drifted-0.16.3", gating.DRIFTED),  # neither a known affected source nor the fix
])
def test_builds_that_are_not_plain_releases_are_judged_by_their_source(version, files, expected, tmp_path):
    locate = extract_modules("deepspeed", files.rpartition("-")[2], PATCH.modules, str(tmp_path))
    if files.startswith("drifted-"):  # a local change to one of the functions the patch rebuilds
        path = locate(PATCH.targets[0].module)
        text = open(path).read().replace("        my_count = count[0]\n", "        my_count = count[0] + 0\n")
        open(path, "w").write(text)
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate)
    assert verdict == expected, reason


def test_diff_bands_cover_exactly_the_affected_releases():
    affected = [v for v in RELEASES if Version(v) <= Version("0.16.3")]
    for version in affected:
        assert sum(SpecifierSet(b).contains(version) for b in PATCH.diffs) == 1, version


def _functions_touching(tree, attribute, prefix=""):
    """{qualname} of the functions (innermost def) whose code reads or writes `.<attribute>`."""
    import ast

    found = set()

    def visit(node, names):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, names + [child.name])
            else:
                if isinstance(child, ast.Attribute) and child.attr == attribute:
                    found.add(".".join(names))
                visit(child, names)

    visit(tree, [])
    return found


@pytest.mark.parametrize("pid", [pid for pid, p in registry.all_patches().items() if p.renamed])
def test_a_rename_covers_every_function_that_touches_the_attribute(pid, tmp_path):
    """Over the whole package of every affected release: no function outside the targets reads or writes the
    renamed attribute (except those declared unrelated, each with its reason)."""
    import ast
    import tarfile

    from upstream_releases import sdist

    patch = registry.all_patches()[pid]
    attribute, exempt = patch.renamed
    top = patch.modules[0].split(".")[0]
    targets = {f"{t.module.replace('.', '/')}.py:{t.qualname}" for t in patch.targets}
    for version in sdist_versions(patch.distribution, "0.0", "999"):
        if not SpecifierSet(patch.affected).contains(version) or not (
                not patch.supported or SpecifierSet(patch.supported).contains(version)):
            continue
        touching = set()
        with tarfile.open(sdist(patch.distribution, version)) as tar:
            for member in tar.getmembers():
                relative = member.name.split("/", 1)[-1]
                if not (member.isfile() and relative.startswith(top + "/") and relative.endswith(".py")):
                    continue
                with tar.extractfile(member) as f:
                    try:
                        tree = ast.parse(f.read())
                    except SyntaxError:
                        continue
                touching |= {f"{relative}:{q}" for q in _functions_touching(tree, attribute)}
        assert touching - set(exempt) == targets, (version, sorted(touching ^ (targets | set(exempt))))
