"""trl/zero3-generation-hooks against every released trl 0.7.0-0.17.0 (sdists from PyPI, plus the wheels of the
releases that have no sdist; nothing executed), with a deepspeed that renamed the method (>= 0.16.4) and with
one that did not; and the diff against every release of its band."""
import ast
import json
import os
import re
import subprocess
import zipfile

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dspatch import data_dir, gating, registry

from upstream_releases import _index, extract_modules, released_fingerprints, sdist_versions, wheel

pytestmark = pytest.mark.unit_only

PID = "trl/zero3-generation-hooks"
PATCH = registry.all_patches()[PID]
RELEASES = sdist_versions("trl", "0.7.0", "0.17.0")
UTILS = "trl/models/utils.py"
DIFF = "trl/0002-zero3-generation-hooks-0.8.2-0.15.2.patch"
NEW_DS, OLD_DS = {"deepspeed": "0.16.9"}, {"deepspeed": "0.16.3"}
# add_hooks' released source, by band (recomputed below from every sdist)
SOURCE_BANDS = {"715953abba3e9aaa": ("0.8.2", "0.14.0"), "a13a05d0629e166a": ("0.15.0", "0.15.2")}
# releases published as wheels only (no sdist), checked from their wheels
WHEEL_ONLY = ["0.9.2", "0.9.3", "0.9.4", "0.9.6", "0.12.1"]


def _within(version, low, high):
    return Version(low) <= Version(version) <= Version(high)


def test_the_release_list_is_complete():
    assert RELEASES[0] == "0.7.0" and RELEASES[-1] == "0.17.0"
    assert {"0.8.1", "0.8.2", "0.8.6", "0.10.1", "0.14.0", "0.15.0", "0.15.2", "0.16.0"} <= set(RELEASES)
    # the releases of the range without an sdist are exactly the wheel-only ones checked below
    files = {f["filename"] for f in _index("trl")["files"]}
    wheels = {name.split("-")[1] for name in files if name.endswith(".whl")}
    in_range = {v for v in wheels if Version("0.7.0") <= Version(v) <= Version("0.17.0")
                and not Version(v).is_prerelease}
    assert in_range - set(RELEASES) == set(WHEEL_ONLY)


def test_declaration():
    assert PATCH.distribution == "trl" and PATCH.affected == ">=0.8.2,<0.16.0" and PATCH.fixed_in == "0.16.0"
    assert PATCH.supported == ">=0.8.2" and PATCH.requires == {"deepspeed": ">=0.16.4"}
    assert [(t.module, t.qualname) for t in PATCH.targets] == [("trl.models.utils", "add_hooks")]
    assert PATCH.diffs == {">=0.8.2,<=0.15.2": DIFF}
    assert "https://github.com/huggingface/trl/pull/2963" in PATCH.links


@pytest.mark.parametrize("version", RELEASES)
def test_verdict_for_release(version, tmp_path):
    locate = extract_modules("trl", version, PATCH.modules, str(tmp_path))
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate, others=NEW_DS)
    _, old_ds, old_reason = gating.evaluate(PATCH, version=version, locate=locate, others=OLD_DS)
    path = locate("trl.models.utils")  # trl < 0.8 has no such module
    source = open(path).read() if path else ""
    if Version(version) >= Version("0.16.0"):
        assert verdict == old_ds == gating.FIXED_UPSTREAM, reason
        assert "_register_deepspeed_module" in source  # upstream's fix (PR 2963)
        return
    if Version(version) < Version("0.8.2"):
        # no add_hooks: unwrap_model_for_generation never takes the hooks off (or does not exist)
        assert "_register_hooks_recursively" not in source and "def add_hooks" not in source
        assert verdict == old_ds == gating.NOT_AFFECTED, reason
        return
    # a deepspeed before the rename (our deepspeed/zero3-module-id keeps the name there): nothing to fix
    assert old_ds == gating.NOT_AFFECTED, old_reason
    assert old_reason == "the bug needs deepspeed>=0.16.4; deepspeed 0.16.3 is installed"
    assert verdict == gating.APPLIES, reason
    low, high = SOURCE_BANDS[gating.fingerprint(locate("trl.models.utils"), "add_hooks")]
    assert _within(version, low, high), version
    assert PATCH.diff_for(version) == DIFF
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), DIFF)], cwd=tmp_path, check=True)


@pytest.mark.parametrize("version", WHEEL_ONLY)
def test_verdict_for_wheel_only_release(version, tmp_path):
    with zipfile.ZipFile(wheel("trl", version)) as release:
        release.extract(UTILS, tmp_path)
    locate = {"trl.models.utils": str(tmp_path / UTILS)}.get
    _, verdict, reason = gating.evaluate(PATCH, version=version, locate=locate, others=NEW_DS)
    assert verdict == gating.APPLIES, reason
    low, high = SOURCE_BANDS[gating.fingerprint(locate("trl.models.utils"), "add_hooks")]
    assert _within(version, low, high), version
    assert PATCH.diff_for(version) == DIFF
    subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), DIFF)], cwd=tmp_path, check=True)


def test_deepspeed_gate_edges():
    def verdict(ds_version):
        # no files: where the deepspeed gate lets it through, the source check refuses (drifted)
        return gating.evaluate(PATCH, version="0.15.2", locate=lambda m: None, others={"deepspeed": ds_version})[1]

    assert verdict("0.16.3") == verdict("0.14.4") == verdict(None) == gating.NOT_AFFECTED
    # 0.16.4 and its local/pre builds are judged as 0.16.4 (deepspeed built from git reports the next release)
    assert verdict("0.16.4") == verdict("0.16.4+abc123") == verdict("0.16.4rc1") == verdict("0.19.8") == \
        gating.DRIFTED


def test_every_recorded_fingerprint_matches_a_release(tmp_path):
    """No stale entries, none missing: the accepted fingerprints are exactly those of 0.8.2-0.15.2."""
    seen = released_fingerprints(PATCH, [v for v in RELEASES if SpecifierSet(PATCH.affected).contains(v)],
                                 tmp_path)
    target = PATCH.targets[0]
    assert set(target.fingerprints) == seen[target.qualname] == set(SOURCE_BANDS)


def test_the_diff():
    text = open(os.path.join(data_dir("upstream_prs"), DIFF)).read()
    for field in ("Description:", "Bug: https://github.com/huggingface/trl/issues/2962",
                  "Forwarded: not-needed", "Applied-Upstream: 0.16.0, https://github.com/huggingface/trl/pull/2963",
                  "Last-Update: 2026-11-23", f"dspatch-Id: {PID}"):
        assert field in text, field
    body = text.split("\n---\n", 1)[1].split("\n-- \n", 1)[0]
    assert re.findall(r"^diff --git a/(\S+)", body, re.M) == [UTILS]
    removed = [line[1:] for line in body.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in body.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert removed == ["    optimizer_offload._register_hooks_recursively(optimizer_offload.module)"]
    # the new name where deepspeed has it, else the old one: works on both sides of the rename
    code = ast.unparse(ast.parse("\n".join(line[4:] for line in added)))
    assert code == ("register = getattr(optimizer_offload, '_register_deepspeed_module', None)\n"
                    "if register is None:\n    register = optimizer_offload._register_hooks_recursively\n"
                    "register(optimizer_offload.module)")


def test_the_diff_is_accepted_by_git_am(tmp_path):
    import tarfile

    from upstream_releases import sdist

    with tarfile.open(sdist("trl", "0.15.2")) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + UTILS))
        (tmp_path / "trl" / "models").mkdir(parents=True)
        (tmp_path / UTILS).write_bytes(tar.extractfile(member).read())
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "trl 0.15.2")
    git("am", os.path.join(data_dir("upstream_prs"), DIFF))
    assert "_register_deepspeed_module" in (tmp_path / UTILS).read_text()
    assert "ZeRO-3 hooks" in git("log", "-1", "--format=%s").stdout


def test_the_transform_renames_exactly_that_call():
    from dspatch.rewrite import RewriteError
    from dspatch.patches.trl.zero3_generation_hooks import new_registration_name

    tree = ast.parse("def add_hooks(model):\n    o = model.optimizer\n    o._register_hooks_recursively(o.module)\n")
    new_registration_name(tree.body[0])
    assert ast.unparse(tree).splitlines()[-1] == "    o._register_deepspeed_module(o.module)"
    for source in ("def add_hooks(model):\n    return model\n",  # nothing to rename: refuse
                   "def add_hooks(o):\n    f = o._register_hooks_recursively\n    f(o.module)\n"):
        with pytest.raises(RewriteError):
            new_registration_name(ast.parse(source).body[0])


def test_the_signature_names_this_bug_only():
    (signature,) = PATCH.signatures
    line = "AttributeError: 'DeepSpeedZeRoOffload' object has no attribute '_register_hooks_recursively'"
    assert re.search(signature, line) and re.search(signature, "[rank1]: " + line)
    for other in ("AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'forward_hooks'",
                  "AttributeError: 'DistributedDataParallel' object has no attribute 'optimizer'"):
        assert not re.search(signature, other)
    assert json.dumps(PATCH.expected_on_stock).count(line) == len(PATCH.expected_on_stock)
