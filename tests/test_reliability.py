"""Reliability with every patch active, on this stack's real upstream code (nox sessions old, bridge, mid, latest):

- numerics: a tiny Llama trained 20 steps at ZeRO-3 and 10 at ZeRO-2 gives bit-identical losses with DSPATCH=1
  and without, and a save_checkpoint / load_checkpoint round trip is exact with DSPATCH=1;
- revert mid-process: every applied patch, reverted, gives back stock behaviour (its reproducer fails again);
- faults: an exception injected into any patch's apply, after part of it was done, leaves the import working
  and nothing of the patch in place; the same patch then applies whole;
- concurrency: the targets imported from two threads at once are patched exactly once.

Drifted targets (every target of every patch) are covered by test_proofs.py; the selection fuzzing and --check on
damaged installs, which need no stack, by test_reliability_unit.py.
"""
import pytest

from dspatch import gating, registry

from conftest import clean_env, last_json, nothing_to_prove, run_python

pytestmark = pytest.mark.stack

APPLICABLE = [pid for pid, p in registry.all_patches().items() if gating.evaluate(p).verdict == gating.APPLIES]

TRAIN = r'''
import json, sys, tempfile
import torch
from dspatch.scenario import init_deepspeed, settle
deepspeed = init_deepspeed()
from transformers import LlamaConfig, LlamaForCausalLM
settle()  # ZeRO-3's set-up collects garbage a dozen times per engine: the imported stack out of its sight

def config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=64)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}}}

def engine(stage, seed):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    return deepspeed.initialize(model=model, config=config(stage), model_parameters=model.parameters())[0]

def train(e, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss)
        e.step()
        losses.append(float(loss))
    return losses

def weights(e):
    params = list(e.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().clone() for n, p in e.module.named_parameters()}

out = {}
for stage, steps in ((3, 20), (2, 10)):
    e = engine(stage, 0)
    out[f"zero{stage}"] = [repr(x) for x in train(e, steps, 1)]
    saved = weights(e)
    with tempfile.TemporaryDirectory() as path:
        e.save_checkpoint(path, tag="t")
        fresh = engine(stage, 7)
        try:
            fresh.load_checkpoint(path, tag="t")
        except Exception as error:
            out[f"zero{stage}_round_trip"] = f"{type(error).__name__}: {str(error)[:80]}"
            continue
    loaded = weights(fresh)
    exact = saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved)
    # and the two continue identically: optimizer and scheduler state came back too
    same = train(e, 2, 3) == train(fresh, 2, 3)
    out[f"zero{stage}_round_trip"] = "exact" if exact and same else f"differs (weights {exact}, next steps {same})"
print(json.dumps(out))
'''


def _train(env):
    proc = run_python(["-c", TRAIN], env=env, warm="base")
    return last_json(proc), proc.stderr


@pytest.fixture(scope="module")
def stock_and_patched():
    return _train(clean_env()), _train(clean_env(DSPATCH="1"))


def test_every_patch_active_training_is_bit_identical_to_stock(stock_and_patched):
    (stock, _), (patched, said) = stock_and_patched
    applied = [line for line in said.splitlines() if line.startswith("dspatch: applied ")]
    # every patch of this stack whose package the job imports was in force
    for pid in APPLICABLE:
        patch = registry.all_patches()[pid]
        if patch.distribution == "deepspeed":
            assert any(pid in line for line in applied), (pid, said[-2000:])
    assert len(patched["zero3"]) == 20 and len(patched["zero2"]) == 10
    assert patched["zero3"] == stock["zero3"] and patched["zero2"] == stock["zero2"]


def test_checkpoint_round_trips_are_exact_with_every_patch_active(stock_and_patched):
    (stock, _), (patched, _) = stock_and_patched
    assert patched["zero3_round_trip"] == "exact" and patched["zero2_round_trip"] == "exact", patched
    if "deepspeed/checkpoint-weights-only" in APPLICABLE:  # stock cannot load its own checkpoints here
        assert stock["zero3_round_trip"].startswith("UnpicklingError: Weights only load failed"), stock
    else:
        assert stock["zero3_round_trip"] == stock["zero2_round_trip"] == "exact", stock


REVERT = r'''
import json, sys
import dspatch
from dspatch import registry
from dspatch.rewrite import upstream_function
from dspatch.spec import BugSeen
behaviour, ids = [p for p in sys.argv[1].split(",") if p], sys.argv[2:]

def state(patch):  # what runs: each target's attribute and the code of upstream's function behind it
    seen = []
    for t in patch.targets:
        owner = sys.modules[t.module]
        *path, name = t.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = vars(owner)[name]
        try:
            function = upstream_function(raw, t, sys.modules[t.module].__file__)
        except Exception:  # behind dspatch's own wrapper (a wrap-style patch): the attribute tells
            function = None
        seen.append((id(raw), id(getattr(function, "__code__", None))))
    return seen

def reproduce(pid):
    patch = registry.all_patches()[pid]
    try:
        patch.scenarios[patch.band_check]()
        return "ok"
    except BugSeen as e:
        return f"bug: {e}"

patches = registry.all_patches()
for pid in ids:  # applied now, not when a reproducer imports them
    for module in patches[pid].modules:
        __import__(module)
stock = {pid: state(patches[pid]) for pid in ids}
outcome = dspatch.apply(ids, strict=True)
result = {"applied": {pid: outcome[pid][0] for pid in ids},
          "changed": {pid: state(patches[pid]) != stock[pid] for pid in ids},
          "patched": {pid: reproduce(pid) for pid in behaviour}}
refused = []
for pid in ids:
    try:
        dspatch.revert([pid])
    except Exception:  # a patch whose live objects need it (zero3-module-id after a ZeRO-3 engine)
        refused.append(pid)
        dspatch.revert([pid], force=True)
result["refused_without_force"] = refused
result["restored"] = {pid: state(patches[pid]) == stock[pid] for pid in ids}
result["reverted"] = {pid: reproduce(pid) for pid in behaviour}
print(json.dumps(result))
'''

# Every patch: after revert, each target holds exactly stock's object and runs stock's code object again
# (so it behaves as stock). These also run a reproducer again (one per kind of change: in-place code, a wrapper,
# accelerate, a save/load path): it fails as stock does.
REVERT_BEHAVIOUR = ("deepspeed/engine-module-hint", "deepspeed/initialize-once",
                    "accelerate/deepspeed-scheduler-param-groups", "deepspeed/frozen-param-names")


def test_revert_mid_process_gives_back_stock_behaviour_for_every_patch():
    if not APPLICABLE:
        nothing_to_prove()
    behaviour = [pid for pid in REVERT_BEHAVIOUR if pid in APPLICABLE]
    out = last_json(run_python(["-c", REVERT, ",".join(behaviour), *APPLICABLE], env=clean_env(), warm="stack"))
    patches = registry.all_patches()
    assert out["applied"] == dict.fromkeys(APPLICABLE, "applied")
    assert out["changed"] == dict.fromkeys(APPLICABLE, True), out
    assert out["restored"] == dict.fromkeys(APPLICABLE, True), out
    assert out["patched"] == dict.fromkeys(behaviour, "ok"), out
    for pid in behaviour:
        fragment = patches[pid].expected_on_stock[patches[pid].band_check]
        assert out["reverted"][pid].startswith("bug:") and fragment in out["reverted"][pid], (pid, out)
    # only patches that say live objects depend on them ask for force
    assert all(patches[pid].in_use for pid in out["refused_without_force"]), out


FAULT = r'''
import importlib, json, sys
import dspatch
from dspatch import _runtime, registry
from dspatch.rewrite import upstream_function

def state(patch):
    seen = []
    for t in patch.targets:
        owner = sys.modules[t.module]
        *path, name = t.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = vars(owner)[name]
        function = upstream_function(raw, t, sys.modules[t.module].__file__)
        seen.append((id(raw), id(function), id(getattr(function, "__code__", None))))
    return seen

result = {}
for pid in sys.argv[1:]:
    patch = registry.all_patches()[pid]
    for module in patch.modules:
        importlib.import_module(module)
    before = state(patch)
    calls = {"n": 0}
    real = {name: getattr(_runtime.Transaction, name) for name in ("recode", "wrap")}
    for name, method in real.items():
        def failing(self, target, *args, _method=method, **kwargs):
            calls["n"] += 1
            if calls["n"] == len(patch.targets):  # after every other change of this patch was made
                raise RuntimeError("injected fault")
            return _method(self, target, *args, **kwargs)
        setattr(_runtime.Transaction, name, failing)
    try:
        failed = dspatch.apply([pid])[pid]
    finally:
        for name, method in real.items():
            setattr(_runtime.Transaction, name, method)
    untouched = state(patch) == before
    again = dspatch.apply([pid])[pid][0]
    dspatch.revert([pid], force=True)
    result[pid] = {"verdict": failed[0], "reason": failed[1], "calls": calls["n"], "untouched": untouched,
                   "again": again, "restored": state(patch) == before}
print(json.dumps(result))
'''


def test_a_fault_in_any_patchs_apply_leaves_nothing_of_it_and_the_import_working():
    if not APPLICABLE:
        nothing_to_prove()
    proc = run_python(["-c", FAULT, *APPLICABLE], env=clean_env(), warm="stack")
    out = last_json(proc)
    for pid in APPLICABLE:
        row = out[pid]
        assert row["verdict"] == "failed" and "RuntimeError: injected fault; left out whole" in row["reason"], row
        assert row["calls"] == len(registry.all_patches()[pid].targets), row  # the fault came last
        assert row["untouched"] and row["again"] == "applied" and row["restored"], (pid, row)


THREADS = r'''
import json, sys, threading
from dspatch import _runtime
errors = []

def load(name, barrier):
    barrier.wait()
    try:
        __import__(name)
    except Exception as e:
        errors.append(f"{name}: {type(e).__name__}: {e}")

# each target module imported by two threads released together (two *different* modules of a package with
# circular imports, transformers', can deadlock in Python's own import locks, with or without dspatch)
for name in sys.argv[1:]:
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=load, args=(name, barrier)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(json.dumps({"errors": errors, "applied": _runtime.applied_ids(),
                  "changes": {pid: txn.changes() for pid, txn in _runtime.state.applied.items()},
                  "targets": {pid: sorted(txn.targets_changed()) for pid, txn in _runtime.state.applied.items()}}))
'''


def test_targets_imported_from_two_threads_at_once_are_patched_exactly_once():
    if not APPLICABLE:
        nothing_to_prove()
    patches = registry.all_patches()
    modules = sorted({m for pid in APPLICABLE for m in patches[pid].modules})
    proc = run_python(["-c", THREADS, *modules], env=clean_env(DSPATCH="1"), warm="base")
    out = last_json(proc)
    assert out["errors"] == [], out
    # every applicable patch applied once: each of its targets changed, no change made twice (a target may take
    # two kinds, rebuilt and wrapped)
    assert sorted(out["applied"]) == sorted(APPLICABLE), out
    for pid in out["applied"]:
        changes = out["changes"][pid]
        assert len(changes) == len(set(changes)), (pid, changes)
        assert set(out["targets"][pid]) == {repr(t) for t in patches[pid].targets}, (pid, changes)
    said = [line for line in proc.stderr.splitlines() if line.startswith("dspatch: applied ")]
    for pid in out["applied"]:
        assert sum(line.count(f"{pid} (") for line in said) == 1, (pid, said)
