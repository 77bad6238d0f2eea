"""What the released sources say about single patches, beyond the shared release suite (tests/test_releases.py):
the facts behind a verdict (where the bug's code is and is not), what each diff changes, and each transform's
parity with its band's diff. Released sources only (sdists, or wheels of releases without one), never executed."""
import ast
import copy
import json
import os
import re
import subprocess
import tarfile

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dspatch import data_dir, gating, registry
from dspatch import upstream

from test_releases import RELEASES, _tree
from upstream_releases import extract_modules, release_tree, release_versions, sdist, tree_locate

pytestmark = pytest.mark.unit_only

PATCHES = registry.all_patches()


def _named(text, patch):
    """Whether dspatch.explain names `patch` in the log `text` (only that patch considered)."""
    from dspatch import explain

    return [item["patch"] for item in explain.find(explain.clean_lines(text), [patch])[0]] == [patch]


def _diff(relative):
    return open(os.path.join(data_dir("upstream_prs"), relative)).read()


def _changed_lines(text):
    """(removed, added) lines of a diff's body, without their +/- and the file headers."""
    body = text.split("\n---\n", 1)[1].split("\n-- \n", 1)[0]  # between the stat and the signature
    removed = [line[1:] for line in body.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in body.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return removed, added


def _member(project, version, relative):
    """One file of a release, by its repository path (None when the release lacks it)."""
    path = os.path.join(release_tree(project, version, [relative]), relative)
    return open(path, "rb").read() if os.path.isfile(path) else None


def _git_am(tree, diff, message):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    git = lambda *a: subprocess.run(["git", *a], cwd=tree, env=env, check=True, capture_output=True,  # noqa: E731
                                    text=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", message)
    git("am", os.path.join(data_dir("upstream_prs"), diff))
    return git("log", "-1", "--format=%s%n%b").stdout


# ---- deepspeed/zero3-module-id ---------------------------------------------------------------------------

MODULE_ID = PATCHES["deepspeed/zero3-module-id"]


@pytest.mark.parametrize("version, files, expected", [
    ("0.16.3+cu121", "0.16.3", gating.APPLIES),     # a local build of a release: its source decides
    ("0.16.4+g1234", "0.16.3", gating.APPLIES),     # git build after 0.16.3 (version.txt bumped), before the fix
    ("0.16.4+g5678", "0.16.4", gating.FIXED_UPSTREAM),  # git build with the fix
    ("0.16.4.dev0", "0.16.4", gating.FIXED_UPSTREAM),
    ("0.16.3.post1", "0.16.3", gating.APPLIES),
    ("0.16.3.post1", "0.16.4", gating.FIXED_UPSTREAM),  # says 0.16.3, has upstream's fix backported
    ("0.16.4+g9999", "drifted-0.16.3", gating.DRIFTED),  # neither a known affected source nor the fix
])
def test_module_id_builds_that_are_not_plain_releases_are_judged_by_their_source(version, files, expected,
                                                                                   tmp_path):
    locate = extract_modules("deepspeed", files.rpartition("-")[2], MODULE_ID.modules, str(tmp_path))
    if files.startswith("drifted-"):  # a local change to one of the functions the patch rebuilds
        path = locate(MODULE_ID.targets[0].module)
        text = open(path).read().replace("        my_count = count[0]\n", "        my_count = count[0] + 0\n")
        open(path, "w").write(text)
    found = gating.evaluate(MODULE_ID, version=version, locate=locate)
    verdict, reason = found.verdict, found.reason
    assert verdict == expected, reason


def _functions_touching(tree, attribute):
    """{qualname} of the functions (innermost def) whose code reads or writes `.<attribute>`."""
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


@pytest.mark.parametrize("pid", [pid for pid, p in PATCHES.items() if p.renamed])
def test_a_rename_covers_every_function_that_touches_the_attribute(pid):
    """Over the whole package of every affected release: no function outside the targets reads or writes the
    renamed attribute (except those declared unrelated, each with its reason)."""
    patch = PATCHES[pid]
    attribute, exempt = patch.renamed
    top = patch.modules[0].split(".")[0]
    targets = {f"{t.module.replace('.', '/')}.py:{t.qualname}" for t in patch.targets}
    for version in release_versions(patch.distribution, "0.0", "999"):
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


# ---- deepspeed/engine-module-hint --------------------------------------------------------------------------

def test_engine_hint_deepspeedexamples_diff_is_well_formed():
    text = _diff("DeepSpeedExamples/0001-deepspeed-chat-print-throughput-engine-module.patch")
    assert "Bug: https://github.com/deepspeedai/DeepSpeedExamples/issues/924" in text
    assert "commit\n 45b4b7156c8794a3452a5a7d03dbd8d797068569" in text  # the head it was made against
    removed, added = _changed_lines(text)
    assert removed == ["                print_throughput(model.model, args, end - start,"] * 2
    assert added == ["                print_throughput(model.module, args, end - start,"] * 2


# ---- deepspeed/checkpoint-weights-only ---------------------------------------------------------------------

WEIGHTS_ONLY = PATCHES["deepspeed/checkpoint-weights-only"]
LOADERS = ("deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py", "deepspeed/runtime/base_optimizer.py",
           "deepspeed/utils/zero_to_fp32.py")


def test_weights_only_torch_gate_edges():
    def verdict(torch_version):
        return gating.evaluate(WEIGHTS_ONLY, version="0.15.4", locate=lambda m: None,
                               others={"torch": torch_version}).verdict

    assert verdict("2.5.1") == verdict("2.4.0") == verdict(None) == gating.NOT_AFFECTED
    # 2.6.0 and its local/pre builds are judged as 2.6 (then the source decides: no files here -> drifted)
    assert verdict("2.6.0") == verdict("2.6.0+cpu") == verdict("2.6.0rc1") == gating.DRIFTED


def test_weights_only_diff_adds_one_keyword_to_each_load():
    (relative,) = WEIGHTS_ONLY.diffs.values()
    removed, added = _changed_lines(_diff(relative))
    assert len(removed) == len(added) == 4  # the diff and the monkeypatch make the same change
    for old, new in zip(removed, added):
        assert "weights_only" not in old and new == old[:-1] + ", weights_only=False)", (old, new)


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
def test_weights_only_targets_are_every_torch_load_of_these_loaders(version):
    """In the three files the patch touches, its targets are exactly the functions that call torch.load
    without weights_only (none are left once upstream's fix is in, 0.16.0)."""
    loads = {}
    for relative in LOADERS:
        source = _member("deepspeed", version, relative)
        module = relative[:-3].replace("/", ".")
        loads.update({(module, q): has for q, has in _torch_loads(ast.parse(source))})
    unset = {key for key, has in loads.items() if not has}
    if Version(version) >= Version("0.16.0"):
        assert unset == set() and len(loads) == len(WEIGHTS_ONLY.targets)
    else:
        assert unset == {(t.module, t.qualname) for t in WEIGHTS_ONLY.targets}


# ---- deepspeed/frozen-param-names --------------------------------------------------------------------------

def test_frozen_names_diffs_make_the_same_change_in_every_band():
    for relative in PATCHES["deepspeed/frozen-param-names"].diffs.values():
        removed, added = _changed_lines(_diff(relative))
        assert not removed  # one method added, one call in each of the three functions
        calls = [line.strip() for line in added if line.strip().startswith("self._refresh_param_names(")]
        assert calls == ["self._refresh_param_names()", "self._refresh_param_names(check=False)",
                         "self._refresh_param_names(update=False)"], (relative, calls)


# ---- deepspeed/initialize-once -----------------------------------------------------------------------------

def test_initialize_once_each_release_takes_its_own_bands_diff_and_no_other():
    patch = PATCHES["deepspeed/initialize-once"]
    for version in RELEASES["deepspeed/initialize-once"]:
        root, _ = _tree("deepspeed/initialize-once", version)
        for relative in patch.diffs.values():
            check = subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), relative)],
                                   cwd=root, capture_output=True)
            assert (check.returncode == 0) == (relative == patch.diff_for(version)), (version, relative)
    for relative in patch.diffs.values():
        assert "create mode 100644 deepspeed/runtime/initialize_guard.py" in _diff(relative)


# ---- accelerate/deepspeed-no-sync --------------------------------------------------------------------------

NO_SYNC = PATCHES["accelerate/deepspeed-no-sync"]


def test_no_sync_deepspeed_asserts_in_no_sync_from_0_16_0():
    """The second half of the gate: `DeepSpeedEngine.no_sync` exists, and asserts that gradients are not
    partitioned, in exactly the releases `requires` names (0.14.0-0.15.4 have no no_sync at all)."""
    for version in release_versions("deepspeed", "0.14.0", "0.19.8"):
        tree = ast.parse(_member("deepspeed", version, "deepspeed/runtime/engine.py"))
        node = upstream.find_definition(tree, "DeepSpeedEngine.no_sync")
        asserting = node is not None and any(
            isinstance(n, ast.Assert) and "zero_optimization_partition_gradients" in ast.dump(n.test)
            for n in ast.walk(node))
        assert asserting == SpecifierSet(NO_SYNC.requires["deepspeed"]).contains(version), version
        assert (node is None) == (not asserting), version


def test_no_sync_the_trainer_reaches_deepspeeds_no_sync_only_through_accelerate():
    """Why there is no transformers patch: the Trainer of every release 4.46.1-4.47.1 (4.46.0 has no sdist) enters
    no_sync only as `self.accelerator.no_sync` (4.46.2-4.47.0 on each micro-step but the last of a window, 4.47.1
    not under DeepSpeed; 4.46.1 through accumulate only), so the fixed Accelerator.no_sync (this patch, or
    accelerate >= 1.9.0) covers it."""
    direct = []
    for version in release_versions("transformers", "4.46.0", "4.47.1"):
        tree = ast.parse(_member("transformers", version, "src/transformers/trainer.py"))
        uses = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and node.attr == "no_sync"]
        assert set(uses) <= {"self.accelerator.no_sync"}, (version, uses)
        direct += [version] if uses else []
    assert direct == ["4.46.2", "4.46.3", "4.47.0", "4.47.1"]


# ---- accelerate/deepspeed-scheduler-param-groups -----------------------------------------------------------

def test_scheduler_param_groups_diffs_add_the_realignment():
    patch = PATCHES["accelerate/deepspeed-scheduler-param-groups"]
    assert patch.diff_for("1.15.0") == "accelerate/0001-deepspeed-scheduler-param-groups.patch"  # to forward
    for relative in patch.diffs.values():
        text = _diff(relative)
        for field in ("Bug: https://github.com/huggingface/transformers/pull/43692",
                      "+def realign_scheduler_param_groups(scheduler, groups_before):",
                      "+                        realign_scheduler_param_groups(scheduler, scheduler_param_groups)"):
            assert field in text, (relative, field)


# ---- transformers/trainer-scheduler-after-deepspeed --------------------------------------------------------

SCHEDULER = "transformers/trainer-scheduler-after-deepspeed"


@pytest.mark.parametrize("version", RELEASES[SCHEDULER][:RELEASES[SCHEDULER].index("5.1.0") + 1])
def test_trainer_scheduler_transforms_give_the_code_of_the_bands_diff(version, tmp_path):
    """Parity of the two forms, for every release: the transforms rebuild both targets into the same code (AST)
    as the band's diff applied to the release."""
    from dspatch.patches.transformers import trainer_scheduler_after_deepspeed as fix

    patch = PATCHES[SCHEDULER]
    root, locate = _tree(SCHEDULER, version)
    work = tmp_path / "tree"
    subprocess.run(["cp", "-r", root, str(work)], check=True)
    subprocess.run(["git", "apply", os.path.join(data_dir("upstream_prs"), patch.diff_for(version))], cwd=work,
                   check=True)
    patched = tree_locate(str(work))
    trainer, optim_sched = patch.targets
    for target, transform in ((trainer, fix.transform_trainer), (optim_sched, fix.no_scheduler_on_the_raw_optimizer)):
        node = copy.deepcopy(upstream.definition(locate(target.module), target.qualname))
        if target is optim_sched and not fix.builds_scheduler_before_prepare(node):
            assert version == "5.1.0"  # 5.1.0 builds no scheduler there: left as it is, and the diff leaves it
        else:
            transform(node)
        assert ast.dump(node) == ast.dump(upstream.definition(patched(target.module), target.qualname)), target


# ---- transformers/peft-zero3-save --------------------------------------------------------------------------

PEFT_SAVE = PATCHES["transformers/peft-zero3-save"]
# the DeepSpeed branch the patch edits, as every affected release has it
BRANCH = """        elif self.is_deepspeed_enabled:
            try:
                state_dict = self.accelerator.get_state_dict(self.deepspeed)
                if self.args.should_save:
                    self._save(output_dir, state_dict=state_dict)
            except ValueError:
                logger.warning(
                    " stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use"
                    " zero_to_fp32.py to recover weights"
                )
                if self.args.should_save:
                    self._save(output_dir, state_dict={})
                # remove the dummy state_dict
                remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
                self.model_wrapped.save_checkpoint(output_dir)
"""


def test_peft_save_the_branch_is_in_every_affected_release_and_gone_in_the_fix():
    for version in RELEASES["transformers/peft-zero3-save"]:
        source = _member("transformers", version, "src/transformers/trainer.py").decode()
        assert source.count(BRANCH) == (0 if Version(version) >= Version("5.0.0") else 1), version
    root, _ = _tree("transformers/peft-zero3-save", "5.0.0")  # PR 41416 changed exactly that branch
    (relative,) = PEFT_SAVE.diffs.values()
    check = subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), relative)], cwd=root,
                           capture_output=True)
    assert check.returncode != 0
    removed, _ = _changed_lines(_diff(relative))
    assert removed == ["                state_dict = self.accelerator.get_state_dict(self.deepspeed)"]


def test_peft_save_signatures_match_the_stock_warning_only():
    line = (" stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use"
            " zero_to_fp32.py to recover weights")
    assert line.strip() in BRANCH.replace('"\n                    "', "")  # the Trainer's own words
    peft = "trainable params: 8,192 || all params: 1,240,064 || trainable%: 0.6606"  # peft's print_trainable_parameters
    assert _named(f"{peft}\n{line}", PEFT_SAVE)
    assert not _named(line, PEFT_SAVE)  # a full model at ZeRO-3 logs it too, and is saved right
    for other in ("ValueError: Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` "
                  "in DeepSpeed config is False.", "Saving model checkpoint to out/checkpoint-2"):
        assert not _named(other, PEFT_SAVE)


# ---- trl/ppo-deepspeed-save --------------------------------------------------------------------------------

PPOV2, PPO = "trl/trainer/ppov2_trainer.py", "trl/trainer/ppo_trainer.py"


@pytest.mark.parametrize("version", [v for v in RELEASES["trl/ppo-deepspeed-save"]
                                     if not SpecifierSet(">=0.11.0,<1.13.0").contains(v)])
def test_ppo_save_why_the_releases_outside_are_not_affected(version):
    source = (_member("trl", version, PPOV2) or b"").decode()
    if version.startswith("0.9."):  # saves correctly: gathers from the engine, strips "policy." itself
        assert "self.deepspeed" not in source and 'k.startswith("policy.")' in source
        assert "state_dict = self.accelerator.get_state_dict(self.backup_model)" in source
    elif version.startswith("0.10."):  # the same save_model, but nothing ever sets self.deepspeed (trl#2025)
        path = os.path.join(release_tree("trl", version, [PPOV2]), PPOV2)
        assert upstream.fingerprint(path, "PPOv2Trainer.save_model") == "054c3942bd1f272e"
        assigned = [line.strip() for line in source.splitlines() if line.strip().startswith("self.deepspeed =")]
        assert assigned == ["self.deepspeed = self.model", "self.deepspeed = backup_deepspeed"]  # save_model's own
    else:  # 1.13.0 and later: no PPO trainer at all
        assert Version(version) >= Version("1.13.0")
        for relative in (PPOV2, PPO, "trl/experimental/ppo/ppo_trainer.py", "trl/trainer/ppo_config.py"):
            assert _member("trl", version, relative) is None


def test_ppo_save_each_diff_says_which_releases_it_applies_to():
    patch = PATCHES["trl/ppo-deepspeed-save"]
    for band, relative in patch.diffs.items():
        inside = [v for v in RELEASES["trl/ppo-deepspeed-save"] if SpecifierSet(band).contains(v)]
        text = _diff(relative)
        assert "Bug: https://github.com/huggingface/trl/issues/2885" in text
        assert "Bug: https://github.com/huggingface/trl/issues/2122" in text
        assert f"as released on PyPI; applies as it is to every\n release {inside[0]}-{inside[-1]}." in text


# ---- trl/zero3-generation-hooks ----------------------------------------------------------------------------

HOOKS = PATCHES["trl/zero3-generation-hooks"]
UTILS = "trl/models/utils.py"


@pytest.mark.parametrize("version", [v for v in RELEASES["trl/zero3-generation-hooks"]
                                     if not SpecifierSet(">=0.8.2,<0.16.0").contains(v)])
def test_generation_hooks_the_releases_outside_have_no_old_call(version):
    source = (_member("trl", version, UTILS) or b"").decode()  # trl < 0.8 has no such module
    if Version(version) >= Version("0.16.0"):
        assert "_register_deepspeed_module" in source  # upstream's fix (PR 2963)
    else:  # no add_hooks: unwrap_model_for_generation never takes the hooks off (or does not exist)
        assert "_register_hooks_recursively" not in source and "def add_hooks" not in source


def test_generation_hooks_deepspeed_gate_edges():
    def verdict(ds_version):
        # no files: where the deepspeed gate lets it through, the source check refuses (drifted)
        return gating.evaluate(HOOKS, version="0.15.2", locate=lambda m: None, others={"deepspeed": ds_version}).verdict

    assert verdict("0.16.3") == verdict("0.14.4") == verdict(None) == gating.NOT_AFFECTED
    # 0.16.4 and its local/pre builds are judged as 0.16.4 (deepspeed built from git reports the next release)
    assert verdict("0.16.4") == verdict("0.16.4+abc123") == verdict("0.16.4rc1") == verdict("0.19.8") == \
        gating.DRIFTED


def test_generation_hooks_diff_and_git_am(tmp_path):
    (relative,) = HOOKS.diffs.values()
    text = _diff(relative)
    assert "Bug: https://github.com/huggingface/trl/issues/2962" in text
    assert re.findall(r"^diff --git a/(\S+)", text.split("\n---\n", 1)[1], re.M) == [UTILS]
    removed, added = _changed_lines(text)
    assert removed == ["    optimizer_offload._register_hooks_recursively(optimizer_offload.module)"]
    # the new name where deepspeed has it, else the old one: works on both sides of the rename
    code = ast.unparse(ast.parse("\n".join(line[4:] for line in added)))
    assert code == ("register = getattr(optimizer_offload, '_register_deepspeed_module', None)\n"
                    "if register is None:\n    register = optimizer_offload._register_hooks_recursively\n"
                    "register(optimizer_offload.module)")
    (tmp_path / "trl" / "models").mkdir(parents=True)
    (tmp_path / UTILS).write_bytes(_member("trl", "0.15.2", UTILS))
    assert "ZeRO-3 hooks" in _git_am(tmp_path, relative, "trl 0.15.2")
    assert "_register_deepspeed_module" in (tmp_path / UTILS).read_text()


def test_generation_hooks_transform_renames_exactly_that_call():
    from dspatch.patches.trl.zero3_generation_hooks import new_registration_name
    from dspatch.rewrite import RewriteError

    tree = ast.parse("def add_hooks(model):\n    o = model.optimizer\n    o._register_hooks_recursively(o.module)\n")
    new_registration_name(tree.body[0])
    assert ast.unparse(tree).splitlines()[-1] == "    o._register_deepspeed_module(o.module)"
    for source in ("def add_hooks(model):\n    return model\n",  # nothing to rename: refuse
                   "def add_hooks(o):\n    f = o._register_hooks_recursively\n    f(o.module)\n"):
        with pytest.raises(RewriteError):
            new_registration_name(ast.parse(source).body[0])


def test_generation_hooks_signature_names_this_bug_only():
    line = "AttributeError: 'DeepSpeedZeRoOffload' object has no attribute '_register_hooks_recursively'"
    assert _named(line, HOOKS) and _named("[rank1]: " + line, HOOKS)
    for other in ("AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'forward_hooks'",
                  "AttributeError: 'DistributedDataParallel' object has no attribute 'optimizer'"):
        assert not _named(other, HOOKS)
    assert json.dumps(HOOKS.expected_on_stock).count(line) == len(HOOKS.expected_on_stock)
