"""deepspeed/checkpoint-weights-only against every released deepspeed 0.14.0-0.19.8 (sdists from PyPI, nothing
executed), with torch 2.13 (the bug needs torch >= 2.6) and with torch 2.5; and the diff against every release of
its band."""
import ast
import os
import subprocess
import tarfile

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dspatch import data_dir, gating, registry

from upstream_releases import extract_modules, released_fingerprints, sdist, sdist_versions

pytestmark = pytest.mark.unit_only

PID = "deepspeed/checkpoint-weights-only"
PATCH = registry.all_patches()[PID]
RELEASES = sdist_versions("deepspeed", "0.14.0", "0.19.8")
NEW_TORCH, OLD_TORCH = {"torch": "2.13.0"}, {"torch": "2.5.1"}
LOADERS = ("deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py", "deepspeed/runtime/base_optimizer.py",
           "deepspeed/utils/zero_to_fp32.py")


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.14.0" and RELEASES[-1] == "0.19.8" and len(RELEASES) >= 45
    assert {"0.14.1", "0.15.4", "0.16.0"} <= set(RELEASES)


def test_declaration():
    assert PATCH.affected == "<=0.15.4" and PATCH.fixed_in == "0.16.0" and PATCH.supported == ">=0.14.1"
    assert PATCH.requires == {"torch": ">=2.6"}


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_for_release(version, tmp_path):
    locate = extract_modules("deepspeed", version, PATCH.modules, str(tmp_path))
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate, others=NEW_TORCH)
    _, old_torch, old_reason = gating.evaluate(PATCH, version=version, locate=locate, others=OLD_TORCH)
    if Version(version) >= Version("0.16.0"):
        assert verdict == old_torch == gating.FIXED_UPSTREAM, reason
        return
    # torch < 2.6 loads with weights_only=False by default: nothing to fix, and --check says why
    assert old_torch == gating.NOT_AFFECTED and old_reason == "the bug needs torch>=2.6; torch 2.5.1 is installed"
    if version == "0.14.0":
        assert verdict == gating.UNSUPPORTED, reason  # other universal loaders; cannot run here
        return
    assert verdict == gating.APPLIES, reason
    diff = PATCH.diff_for(version)
    assert diff == "deepspeed/0002-checkpoint-weights-only-0.14.1-0.15.4.patch", version
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), diff)], cwd=tmp_path,
                   check=True)


def test_torch_gate_edges():
    def verdict(torch_version):
        return gating.evaluate(PATCH, version="0.15.4", locate=lambda m: None, others={"torch": torch_version})[1]

    assert verdict("2.5.1") == verdict("2.4.0") == gating.NOT_AFFECTED
    # 2.6.0 and its local/pre builds are judged as 2.6 (then the source decides: no files here -> drifted)
    assert verdict("2.6.0") == verdict("2.6.0+cpu") == verdict("2.6.0rc1") == gating.DRIFTED
    assert gating.evaluate(PATCH, version="0.15.4", locate=lambda m: None, others={"torch": None})[1] == \
        gating.NOT_AFFECTED  # torch not installed


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    """No stale entries, none missing: the accepted fingerprints are exactly those of 0.14.1-0.15.4."""
    seen = released_fingerprints(PATCH, [v for v in RELEASES if SpecifierSet(PATCH.affected).contains(v)
                                         and SpecifierSet(PATCH.supported).contains(v)], tmp_path)
    for t in PATCH.targets:
        assert set(t.fingerprints) == seen[t.qualname], t


def test_diff_band_covers_exactly_the_supported_affected_releases():
    for version in RELEASES:
        wanted = Version("0.14.1") <= Version(version) <= Version("0.15.4")
        assert sum(SpecifierSet(b).contains(version) for b in PATCH.diffs) == int(wanted), version
    for path in PATCH.diffs.values():
        text = open(os.path.join(data_dir("upstream_prs"), path)).read()
        for field in ("Description:", "Bug: https://github.com/deepspeedai/DeepSpeed/pull/6751",
                      "Forwarded: not-needed", "Applied-Upstream: 0.16.0, https://github.com/deepspeedai/DeepSpeed/pull/6751",
                      "Last-Update: 2026-11-23", f"dspatch-Id: {PID}"):
            assert field in text, (path, field)
        body = text.split("\n---\n", 1)[1].split("\n-- \n", 1)[0]  # between the stat and the signature
        changed = [line for line in body.splitlines() if line[:1] in ("+", "-") and line[:4] not in ("+++ ", "--- ")]
        # the diff and the monkeypatch make the same change: one keyword added to each target's torch.load
        assert len(changed) == 2 * 4
        for old, new in zip(changed[0::2], changed[1::2]):
            assert old.startswith("-") and new.startswith("+") and "weights_only" not in old
            assert new[1:] == old[1:-1] + ", weights_only=False)", (old, new)


def _torch_loads(tree):
    """{(qualname of the innermost def, has weights_only)} for every `torch.load(...)` call in a module."""
    found = set()

    def visit(node, names):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, names + [child.name])
                continue
            if isinstance(child, ast.Call) and ast.unparse(child.func) == "torch.load":
                found.add((".".join(names), any(k.arg == "weights_only" for k in child.keywords)))
            visit(child, names)

    visit(tree, [])
    return found


@pytest.mark.parametrize("version", ["0.14.1", "0.14.4", "0.15.4", "0.16.0"])
def test_the_targets_are_every_torch_load_of_these_loaders(version):
    """In the three files the patch touches, its targets are exactly the functions that call torch.load
    without weights_only (none are left once upstream's fix is in, 0.16.0)."""
    loads = {}
    with tarfile.open(sdist("deepspeed", version)) as tar:
        for member in tar.getmembers():
            relative = member.name.split("/", 1)[-1]
            if relative in LOADERS:
                with tar.extractfile(member) as f:
                    module = relative[:-3].replace("/", ".")
                    loads.update({(module, q): has for q, has in _torch_loads(ast.parse(f.read()))})
    unset = {key for key, has in loads.items() if not has}
    if Version(version) >= Version("0.16.0"):
        assert unset == set() and len(loads) == len(PATCH.targets)
    else:
        assert unset == {(t.module, t.qualname) for t in PATCH.targets}
