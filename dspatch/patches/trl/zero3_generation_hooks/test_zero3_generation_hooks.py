"""trl/zero3-generation-hooks against the real trl + deepspeed of this stack (nox sessions old, bridge, mid, latest).

Affected (bridge: trl 0.15.2 on deepspeed 0.16.9): stock reproduces the bug (generation under ZeRO-3, and a real
RLOOTrainer run), DSPATCH=1 fixes it, the upstream diff applied to a copy of the installed trl fixes it with no
monkeypatch (its generation reproducer; the trainer one runs stock and patched), and the patched trl puts back exactly the hooks trl 0.16.0 (upstream's fix) puts back, with the
same training afterwards. Elsewhere (old: deepspeed 0.14.4 keeps the old name, also with deepspeed/zero3-module-id
applied; mid, latest: trl fixed) the patch stays out and the same reproducers pass.
"""
import json
import tarfile

import pytest
from packaging.version import Version

from dspatch import gating, registry
from dspatch import upstream

from conftest import apply_upstream_diff, clean_env, run_python, verify
from packaging.specifiers import SpecifierSet
from test_releases import RELEASES
from upstream_releases import changed_lines
from upstream_releases import diff_text
from upstream_releases import git_am
from upstream_releases import member
from upstream_releases import named
import ast
import re

pytestmark = pytest.mark.stack

PID = "trl/zero3-generation-hooks"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}
STOCK_ERROR = "AttributeError: 'DeepSpeedZeRoOffload' object has no attribute '_register_hooks_recursively'"


def _version(distribution):
    return Version(upstream.installed_version(distribution))


def affected():
    return Version("0.8.2") <= _version("trl") < Version("0.16.0") and _version("deepspeed") >= Version("0.16.4")


def test_verdict_on_this_stack():
    found = gating.evaluate(PATCH)
    verdict, reason = found.verdict, found.reason
    if affected():
        assert verdict == gating.APPLIES, reason
    elif _version("trl") >= Version("0.16.0"):
        assert verdict == gating.FIXED_UPSTREAM, reason
    else:
        assert verdict == gating.NOT_AFFECTED and "the bug needs deepspeed>=0.16.4" in reason, reason


def test_stock_upstream_reproduces_the_bug():
    outcome = verify(PID, clean_env())
    assert outcome["applied"] == []
    if affected():
        for name, fragment in PATCH.expected_on_stock.items():
            assert outcome["results"][name].startswith("bug: ") and fragment in outcome["results"][name], name
            assert STOCK_ERROR in outcome["results"][name]
    else:  # trl fixed, or a deepspeed that still has the old name: upstream works as it is
        assert outcome["results"] == ALL_OK, outcome


def test_dspatch_env_fixes_it_and_stays_out_elsewhere():
    outcome = verify(PID, clean_env(DSPATCH="1"))  # every patch that applies, as users run it
    assert outcome["results"] == ALL_OK, outcome
    assert (PID in outcome["applied"]) == affected(), outcome["applied"]
    if _version("deepspeed") <= Version("0.16.3"):
        # the combination: deepspeed/zero3-module-id renames `.id` and keeps the method's old name, which
        # trl's add_hooks calls; generation and an RLOO run at ZeRO-3 work with both active
        assert "deepspeed/zero3-module-id" in outcome["applied"] and PID not in outcome["applied"]


def _apply_diff(site, version):
    apply_upstream_diff(PATCH, version, site)


def test_upstream_diff_keeps_working_with_a_deepspeed_before_the_rename(package_copy):
    """The diff asks deepspeed for the new name and falls back to the old one: a trl with it applied still
    generates and trains at ZeRO-3 on deepspeed <= 0.16.3 (stock, and with deepspeed/zero3-module-id)."""
    trl_version = str(_version("trl"))
    if _version("deepspeed") >= Version("0.16.4") or not PATCH.diff_for(trl_version):
        pytest.skip("for a trl the diff covers on a deepspeed before the rename (old stack)")
    site, _ = package_copy("trl")
    _apply_diff(site, trl_version)
    for env in (clean_env(PYTHONPATH=site), clean_env(PYTHONPATH=site, DSPATCH="deepspeed/zero3-module-id")):
        outcome = verify(PID, env, "--only", "generate_then_train")
        assert outcome["results"] == {"generate_then_train": "ok"}, (env.get("DSPATCH"), outcome)


# What ZeRO-3 has on the model before, after each generation and after training, the modules' numbers, the
# losses and the final weights: with generation after steps 0 and 2, and without any (the same training).
PROBE = r'''
import hashlib, json
import torch
from dspatch.patches.trl.zero3_generation_hooks import reproducers as z
from dspatch.spec import BugSeen

def digest(params):
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode()); h.update(params[name].float().numpy().tobytes())
    return h.hexdigest()

def run(generate_after):
    accelerator, engine = z._prepared()
    before = z._hook_state(engine)
    losses, states = [], []
    for step in range(4):
        losses.append(z._step(accelerator, engine, step))
        if step in generate_after:
            z._generate(accelerator, engine)
            states.append(z._hook_state(engine))
    ids = [getattr(m, "ds_id", getattr(m, "id", None)) for m in engine.module.modules()]
    ids = [i - ids[0] for i in ids]  # DeepSpeed's counter is per process: numbers relative to the model's own
    return {"before": before, "after_generation": states, "after": z._hook_state(engine), "losses": losses,
            "weights": digest(z._params(engine)), "module_numbers": ids}

import sys
z._warm_up()  # the first engine of a process trains slightly differently: never compared
parts = sys.argv[1:] or ["plain", "generation"]
report = {"plain": run(())} if "plain" in parts else {}
if "generation" in parts:
    try:
        report["with_generation"] = run((0, 2))
    except BugSeen as e:
        report["with_generation"] = "bug: " + str(e)
print("R " + json.dumps(report))
'''


def _probe(env, *args):
    out = run_python(["-c", PROBE, *args], env=env, warm="stack").stdout
    return json.loads([line for line in out.splitlines() if line.startswith("R ")][-1][2:])


def _trl_release(version, into):
    from upstream_releases import sdist

    with tarfile.open(sdist("trl", version)) as tar:
        members = [m for m in tar.getmembers() if m.name.split("/", 1)[-1].split("/")[0] == "trl"]
        tar.extractall(into, members=members, filter="tar")
    return str(next(into.iterdir()))


def test_hooks_and_training_are_those_of_trl_0_16(tmp_path):
    """Patched trl 0.15.2 and trl 0.16.0 as released (upstream's fix, same deepspeed, transformers, accelerate)
    agree on everything: the hooks ZeRO-3 has after each generation (counts and the modules hooked, those of
    before generation), the modules' numbering (re-registration renumbers them, upstream too), every parameter
    released after the steps, the losses and the final weights, which are also those of the same training
    without generation; and where no generation happens, patched training is bit-identical to stock."""
    if not affected():
        pytest.skip("compared where the patch applies (trl <= 0.15.2, deepspeed >= 0.16.4)")
    stock = _probe(clean_env(), "plain")  # stock's generation fails: the stock reproducer shows it
    patched = _probe(clean_env(DSPATCH=PID))
    # training alone never reaches trl: trl 0.16.0's run with generation is the one to compare
    fixed_upstream = _probe(clean_env(PYTHONPATH=_trl_release("0.16.0", tmp_path)), "generation")
    assert patched["plain"] == stock["plain"]  # bit-identical where no bug is hit
    assert patched["with_generation"] == fixed_upstream["with_generation"]
    generated = patched["with_generation"]
    assert generated["after_generation"] == [generated["before"]] * 2 and generated["after"] == generated["before"]
    assert generated["before"]["forward_hooks"] > 0 and generated["before"]["hooked_modules"]
    assert generated["after"]["held_parameters"] == []
    assert generated["losses"] == patched["plain"]["losses"] and generated["weights"] == patched["plain"]["weights"]


def test_apply_after_import_and_revert():
    """dspatch.apply() after trl is imported patches add_hooks in place (same function object, code rebuilt
    from the installed file with the one name changed, same line numbers); revert restores upstream's code."""
    if not affected():
        pytest.skip("nothing to apply here")
    code = r'''
import dis, json
import trl.models.utils as u
import dspatch
from dspatch.patches.trl.zero3_generation_hooks import reproducers as z
from dspatch.spec import BugSeen
function, code = u.add_hooks, u.add_hooks.__code__
names = lambda c: sorted({i.argval for i in dis.get_instructions(c) if i.opname in ("LOAD_ATTR", "LOAD_METHOD")})
def outcome():  # one engine, one step, one generation
    accelerator, engine = z._prepared()
    z._step(accelerator, engine, 0)
    try:
        z._generate(accelerator, engine); return "ok"
    except BugSeen:
        return "bug"
applied = dspatch.apply(["trl/zero3-generation-hooks"])["trl/zero3-generation-hooks"][0]
new = u.add_hooks.__code__
report = {"applied": applied, "same_object": u.add_hooks is function, "line": new.co_firstlineno == code.co_firstlineno,
          "file": new.co_filename == code.co_filename,
          "added": sorted(set(names(new)) - set(names(code))), "removed": sorted(set(names(code)) - set(names(new))),
          "patched": outcome()}
dspatch.revert(["trl/zero3-generation-hooks"])
report["restored"] = u.add_hooks.__code__ is code
report["after_revert"] = outcome()
print("R " + json.dumps(report))
'''
    out = run_python(["-c", code], warm="stack").stdout
    report = json.loads([line for line in out.splitlines() if line.startswith("R ")][-1][2:])
    assert report == {"applied": "applied", "same_object": True, "line": True, "file": True,
                      "added": ["_register_deepspeed_module"], "removed": ["_register_hooks_recursively"],
                      "patched": "ok", "restored": True, "after_revert": "bug"}


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

HOOKS = registry.all_patches()["trl/zero3-generation-hooks"]
UTILS = "trl/models/utils.py"


@pytest.mark.unit_only  # released sources only: once, in the unit session
@pytest.mark.parametrize("version", [v for v in RELEASES["trl/zero3-generation-hooks"]
                                     if not SpecifierSet(">=0.8.2,<0.16.0").contains(v)])
def test_generation_hooks_the_releases_outside_have_no_old_call(version):
    source = (member("trl", version, UTILS) or b"").decode()  # trl < 0.8 has no such module
    if Version(version) >= Version("0.16.0"):
        assert "_register_deepspeed_module" in source  # upstream's fix (PR 2963)
    else:  # no add_hooks: unwrap_model_for_generation never takes the hooks off (or does not exist)
        assert "_register_hooks_recursively" not in source and "def add_hooks" not in source


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_generation_hooks_deepspeed_gate_edges():
    def verdict(ds_version):
        # no files: where the deepspeed gate lets it through, the source check refuses (drifted)
        return gating.evaluate(HOOKS, version="0.15.2", locate=lambda m: None, others={"deepspeed": ds_version}).verdict

    assert verdict("0.16.3") == verdict("0.14.4") == verdict(None) == gating.NOT_AFFECTED
    # 0.16.4 and its local/pre builds are judged as 0.16.4 (deepspeed built from git reports the next release)
    assert verdict("0.16.4") == verdict("0.16.4+abc123") == verdict("0.16.4rc1") == verdict("0.19.8") == \
        gating.DRIFTED


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_generation_hooks_diff_and_git_am(tmp_path):
    (relative,) = HOOKS.diffs.values()
    text = diff_text(relative)
    assert "Bug: https://github.com/huggingface/trl/issues/2962" in text
    assert re.findall(r"^diff --git a/(\S+)", text.split("\n---\n", 1)[1], re.M) == [UTILS]
    removed, added = changed_lines(text)
    assert removed == ["    optimizer_offload._register_hooks_recursively(optimizer_offload.module)"]
    # the new name where deepspeed has it, else the old one: works on both sides of the rename
    code = ast.unparse(ast.parse("\n".join(line[4:] for line in added)))
    assert code == ("register = getattr(optimizer_offload, '_register_deepspeed_module', None)\n"
                    "if register is None:\n    register = optimizer_offload._register_hooks_recursively\n"
                    "register(optimizer_offload.module)")
    (tmp_path / "trl" / "models").mkdir(parents=True)
    (tmp_path / UTILS).write_bytes(member("trl", "0.15.2", UTILS))
    assert "ZeRO-3 hooks" in git_am(tmp_path, relative, "trl 0.15.2")
    assert "_register_deepspeed_module" in (tmp_path / UTILS).read_text()


@pytest.mark.unit_only  # released sources only: once, in the unit session
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


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_generation_hooks_signature_names_this_bug_only():
    line = "AttributeError: 'DeepSpeedZeRoOffload' object has no attribute '_register_hooks_recursively'"
    assert named(line, HOOKS) and named("[rank1]: " + line, HOOKS)
    for other in ("AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'forward_hooks'",
                  "AttributeError: 'DistributedDataParallel' object has no attribute 'optimizer'"):
        assert not named(other, HOOKS)
    assert json.dumps(HOOKS.expected_on_stock).count(line) == len(HOOKS.expected_on_stock)
