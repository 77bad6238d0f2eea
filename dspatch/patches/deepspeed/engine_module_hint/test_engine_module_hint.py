"""deepspeed/engine-module-hint against the real deepspeed of this stack (nox sessions old, mid, latest).

Stock reproduces the bare message exactly, DSPATCH=1 adds the hint, the upstream diff applied to a copy of the
installed deepspeed gives the same message with no monkeypatch, everything else stays stock (hasattr, getattr
with a default, `name`/`obj`, chaining, names that resolve today, copies, a half-built engine), leaving the target
out or changing its source leaves the stock message, and DeepSpeed-Chat's fixed call shape works.
"""
import json
import os

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import apply_upstream_diff, clean_env, deepspeed_version, run_python, verify
from upstream_releases import changed_lines
from upstream_releases import diff_text

pytestmark = pytest.mark.stack

PID = "deepspeed/engine-module-hint"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}
STOCK = {  # exactly what stock upstream says, as the reproducers report it
    "gpt2_engine_model": "bug: AttributeError: 'DeepSpeedEngine' object has no attribute 'model' "
                         "(no word of `engine.module` or GPT2LMHeadModel)",
    "reward_engine_model": "bug: AttributeError: 'DeepSpeedEngine' object has no attribute 'model' "
                           "(no word of `engine.module` or RewardModel)",
    "pipeline_engine_model": "bug: AttributeError: 'PipelineEngine' object has no attribute 'model' "
                             "(no word of `engine.module` or PipelineModule)",
}
HINTED = ("'DeepSpeedEngine' object has no attribute 'model'. The model this engine wraps (GPT2LMHeadModel) is "
          "`engine.module`: did you mean `engine.module`?")


def test_this_stack_is_covered():
    assert gating.evaluate(PATCH).verdict == gating.APPLIES


def test_stock_upstream_reproduces_the_bare_message_exactly():
    outcome = verify(PID, clean_env())
    assert outcome["applied"] == [] and outcome["results"] == STOCK


def _apply_diff(site):
    apply_upstream_diff(PATCH, deepspeed_version(), site)


# Everything that must stay as stock, observed in one process per form; the reports must be equal except the
# messages of the misses, which must be the stock message plus the hint.
OBSERVE = r'''
import copy, json, pickle, sys, traceback
form = sys.argv[1]
if form == "monkeypatch":
    import dspatch; dspatch.apply(["deepspeed/engine-module-hint"], strict=True)
import torch
from dspatch.patches.deepspeed.engine_module_hint.reproducers import engine_for, gpt2_model, reward_model
from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import LlamaConfig, LlamaForCausalLM

def outcome(fn):
    try:
        value = fn()
        return ["ok", type(value).__name__]
    except BaseException as e:
        return [type(e).__name__, str(e)[:300]]

def miss(engine, name):
    try:
        getattr(engine, name)
    except AttributeError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return {"type": type(e).__name__, "name": e.name, "obj_is_engine": e.obj is engine,
                "cause": repr(e.__cause__), "context": type(e.__context__).__name__,
                "suppress": e.__suppress_context__, "raised_at": [frame.filename.rsplit("/", 3)[-3:], frame.lineno],
                "message": str(e)}
    return "resolved"

report = {}
gpt2 = engine_for(gpt2_model())
report["gpt2.model"] = miss(gpt2, "model")
report["gpt2.nope"] = miss(gpt2, "nope")
report["hasattr"] = [hasattr(gpt2, "model"), hasattr(gpt2, "nope"), hasattr(gpt2, "transformer")]
report["getattr default"] = [getattr(gpt2, "model", 7), getattr(gpt2, "nope", None)]
report["resolves"] = {"transformer": gpt2.transformer is gpt2.module.transformer,
                      "lm_head": gpt2.lm_head is gpt2.module.lm_head,
                      "generation_config": gpt2.generation_config is gpt2.module.generation_config,
                      "get_input_embeddings": gpt2.get_input_embeddings() is gpt2.module.get_input_embeddings(),
                      "module": gpt2.module is gpt2.__dict__["module"]}
reward = engine_for(reward_model())
report["reward.model"] = miss(reward, "model")
report["reward resolves"] = [reward.rwtransformer is reward.module.rwtransformer, reward.v_head is reward.module.v_head]
torch.manual_seed(0)
llama = engine_for(LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)))
report["llama.model is module.model"] = llama.model is llama.module.model  # the accidental pass-through
report["copy"] = outcome(lambda: copy.copy(gpt2).module is gpt2.module)
report["pickle"] = outcome(lambda: pickle.dumps(gpt2))
half = DeepSpeedEngine.__new__(DeepSpeedEngine)  # as unpickling sees it, before __dict__ is filled
sys.setrecursionlimit(400)
report["half-built hasattr"] = outcome(lambda: hasattr(half, "nope"))
report["half-built getattr"] = outcome(lambda: getattr(half, "nope"))
report["half-built default"] = outcome(lambda: getattr(half, "nope", "d"))
print("R " + json.dumps(report))
'''


def _observe(form, env):
    proc = run_python(["-c", OBSERVE, form], env=env, warm="stack")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])


@pytest.mark.parametrize("form", ["monkeypatch", "diff"])
def test_everything_else_stays_stock(form, deepspeed_copy):
    stock = _observe("stock", clean_env())
    env = clean_env()
    if form == "diff":
        site, _ = deepspeed_copy
        _apply_diff(site)
        env = clean_env(PYTHONPATH=site)
    fixed = _observe(form, env)
    for key, kind in (("gpt2.model", "GPT2LMHeadModel"), ("gpt2.nope", "GPT2LMHeadModel"),
                      ("reward.model", "RewardModel")):
        bare = stock[key].pop("message")
        name = key.split(".")[1]
        assert bare == f"'DeepSpeedEngine' object has no attribute '{name}'"
        ask = ": did you mean `engine.module`?" if name == "model" else "."
        assert fixed[key].pop("message") == f"{bare}. The model this engine wraps ({kind}) is `engine.module`{ask}"
        if form == "diff":  # the diff adds lines above the raise in the same file
            stock[key].pop("raised_at"), fixed[key].pop("raised_at")
    assert stock["gpt2.model"]["type"] == "AttributeError" and stock["gpt2.model"]["name"] == "model"
    assert stock["gpt2.model"]["obj_is_engine"] is True
    assert stock["hasattr"] == [False, False, True] and stock["getattr default"] == [7, None]
    assert all(stock["resolves"].values()) and stock["reward resolves"] == [True, True]
    assert stock["llama.model is module.model"] is True
    assert fixed == stock


def test_the_target_is_necessary():
    """With the patch applied less its (one) target, the reproducers show the stock message again."""
    code = r'''
import json, dspatch
import deepspeed.runtime.engine  # imported first, so that apply() acts at once
from dspatch import _runtime, registry
from dspatch.verify import run_scenarios
patch = registry.all_patches()["deepspeed/engine-module-hint"]
real = _runtime.Transaction.recode
report = {}
for target in patch.targets:
    _runtime.Transaction.recode = lambda self, t, transform: None if t is target else real(self, t, transform)
    verdict = dspatch.apply([patch.id], strict=True)[patch.id][0]
    report[target.qualname] = [verdict, run_scenarios(patch)]
    dspatch.revert([patch.id])
_runtime.Transaction.recode = real
print("R " + json.dumps(report))
'''
    proc = run_python(["-c", code], warm="stack")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    assert set(report) == {t.qualname for t in PATCH.targets}
    for qualname, (verdict, results) in report.items():
        assert verdict == gating.APPLIED and results == STOCK, (qualname, results)


def _drift(package, target):
    """Change one target function the way a fork or a dev build would (one statement added to its body)."""
    path = os.path.join(package, *target.module.split(".")[1:]) + ".py"
    node = upstream.definition(path, target.qualname)
    lines = open(path).read().split("\n")
    first = node.body[-1]
    indent = lines[first.lineno - 1][:first.col_offset]
    lines.insert(first.lineno - 1, f"{indent}_local_change = None")
    open(path, "w").write("\n".join(lines))


@pytest.mark.parametrize("qualname", [t.qualname for t in PATCH.targets])
def test_a_drifted_target_keeps_the_patch_out(qualname, deepspeed_copy):
    site, package = deepspeed_copy
    target = next(t for t in PATCH.targets if t.qualname == qualname)
    _drift(package, target)
    proc = run_python(["-m", "dspatch.verify", PID, "--only", "gpt2_engine_model"],
                      env=clean_env(PYTHONPATH=site, DSPATCH=PID), warm="base")
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch:")]
    assert len(said) == 1 and f"{PID} skipped" in said[0] and str(target) in said[0], said
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (outcome["applied"], outcome["results"]) == ([], {"gpt2_engine_model": STOCK["gpt2_engine_model"]})
    check = run_python(["-m", "dspatch.apply", "--check", "--json", "--only", PID], env=clean_env(PYTHONPATH=site),
                       check=False)
    row = next(r for r in json.loads(check.stdout)["patches"] if r["id"] == PID)
    assert row["verdict"] == gating.DRIFTED and str(target) in row["reason"]


def test_apply_twice_and_revert_restore_upstreams_code():
    code = r'''
import dspatch
from deepspeed.runtime.engine import DeepSpeedEngine
function = DeepSpeedEngine.__dict__["__getattr__"]
stock = function.__code__
first = dspatch.apply(["deepspeed/engine-module-hint"])["deepspeed/engine-module-hint"][0]
patched = function.__code__
second = dspatch.apply(["deepspeed/engine-module-hint"])["deepspeed/engine-module-hint"][0]
same = DeepSpeedEngine.__dict__["__getattr__"] is function and function.__code__ is patched
lines = (patched.co_firstlineno == stock.co_firstlineno, patched.co_filename == stock.co_filename)
dspatch.revert()
print("R", first, second, same, patched is not stock, lines == (True, True), function.__code__ is stock)
'''
    out = [line for line in run_python(["-c", code], warm="stack").stdout.splitlines() if line.startswith("R ")][-1]
    assert out == "R applied applied True True True True"


# DeepSpeed-Chat steps 1 and 2 (DeepSpeedExamples#924) pass `model.model` to print_throughput, where `model` is
# the engine; upstream_prs/DeepSpeedExamples/0001-*.patch passes `model.module`. What print_throughput does with
# that argument (read `.config` and its sizes, count `.parameters()`, set `._num_params`), on a GPT-2 engine:
CALL_SHAPE = r'''
import json
from dspatch.patches.deepspeed.engine_module_hint.reproducers import engine_for, gpt2_model

def throughput_reads(hf_model):
    config = hf_model.config
    sizes = (config.num_hidden_layers, config.hidden_size, config.vocab_size)
    hf_model._num_params = sum(p.numel() for p in hf_model.parameters())
    return sizes, hf_model._num_params

engine = engine_for(gpt2_model())
report = {"fixed call (engine.module)": list(throughput_reads(engine.module))}
try:
    throughput_reads(engine.model)
    report["old call (engine.model)"] = "worked"
except AttributeError as e:
    report["old call (engine.model)"] = str(e)
print("R " + json.dumps(report))
'''


@pytest.mark.parametrize("dspatch_on", [False, True])
def test_deepspeed_chat_fixed_call_shape(dspatch_on):
    env = clean_env(DSPATCH=PID) if dspatch_on else clean_env()
    out = [line for line in run_python(["-c", CALL_SHAPE], env=env, warm="stack").stdout.splitlines() if line.startswith("R ")]
    report = json.loads(out[-1][2:])
    assert report["fixed call (engine.module)"][0] == [2, 32, 128]
    assert report["fixed call (engine.module)"][1] > 0
    assert report["old call (engine.model)"] == (HINTED if dspatch_on else
                                                 "'DeepSpeedEngine' object has no attribute 'model'")


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_engine_hint_deepspeedexamples_diff_is_well_formed():
    text = diff_text("DeepSpeedExamples/0001-deepspeed-chat-print-throughput-engine-module.patch")
    assert "Bug: https://github.com/deepspeedai/DeepSpeedExamples/issues/924" in text
    assert "commit\n 45b4b7156c8794a3452a5a7d03dbd8d797068569" in text  # the head it was made against
    removed, added = changed_lines(text)
    assert removed == ["                print_throughput(model.model, args, end - start,"] * 2
    assert added == ["                print_throughput(model.module, args, end - start,"] * 2
