"""transformers/peft-zero3-save against the real transformers + peft + accelerate + deepspeed of this stack (nox
sessions old, bridge, mid: transformers 4.44.2 / 4.46.3 / 4.57.6, patched; latest: 5.23.0, fixed upstream).

Stock reproduces the empty adapter exactly (checkpoint-2 and save_model, LoRA partitioned and persistent); the
patch (DSPATCH) and the upstream diff applied to a copy of the installed transformers (no monkeypatch) each save the
trained adapter exactly, loadable with PeftModel.from_pretrained, without gathering a frozen weight; in a 2-rank
torchrun job every rank gathers and only the main one writes; with the gather flag on, and without PEFT, a patched
process saves bit-identical files to stock. On 5.x the same reproducers show upstream's fix saving the adapter, and
that it gathers the frozen weights whole on the way. Leaving out the target and drifting it: test_proofs.py.
"""
import json
import re
import socket

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import clean_env, run_python, STACK, verify, verify_log, verify_patched, with_gather_fix
from dspatch import data_dir
from packaging.version import Version
from test_releases import RELEASES
from test_releases import _tree
from upstream_releases import changed_lines
from upstream_releases import diff_text
from upstream_releases import member
from upstream_releases import named
import os
import subprocess

pytestmark = pytest.mark.stack

PID = "transformers/peft-zero3-save"
PATCH = registry.all_patches()[PID]
VERDICT = gating.evaluate(PATCH)
ALL_OK = {name: "ok" for name in PATCH.scenarios}
EMPTY = "bug: checkpoint-2: adapter_model.safetensors holds 0 of 8 trained tensors (40 bytes)"
STOCK = {"peft_save_partitioned": EMPTY, "peft_save_persistent": EMPTY, "peft_gather_flag_on": "ok",
         "no_peft_unchanged": "ok"}
FROZEN_GATHERED = "error: AssertionError: save_model gathered frozen base weights whole"

affected = pytest.mark.skipif(VERDICT.verdict != gating.APPLIES,
                              reason=f"{PID} does not apply here: {VERDICT.verdict} ({VERDICT.reason})")


def _transformers_version():
    return upstream.installed_version("transformers")


def test_verdict_on_this_stack():
    version = _transformers_version()
    if STACK in ("old", "bridge", "mid"):
        assert VERDICT.verdict == gating.APPLIES, VERDICT
    elif STACK == "latest":
        assert VERDICT.verdict == gating.FIXED_UPSTREAM, VERDICT
    assert (VERDICT.verdict == gating.APPLIES) == (int(version.split(".")[0]) < 5), (version, VERDICT)


@pytest.fixture(scope="module")
def stock():
    """The stock run, once for this file: (outcome, stderr). (conftest's memo is keyed by the environment, which
    pytest changes for every test through PYTEST_CURRENT_TEST.)"""
    env = clean_env()
    return verify(PID, env), verify_log(PID, env)


@affected
def test_stock_upstream_reproduces_exactly(stock):
    outcome, _ = stock
    assert outcome["applied"] == [] and outcome["results"] == STOCK


def _warnings(log):
    """Every line of the log with the Trainer's fallback warning (the message of the patch's signature)."""
    (signature,) = PATCH.signatures
    return [line for line in log.splitlines() if re.search(signature.message, line)]


@affected
def test_stock_log_carries_the_signature(stock):
    """The bug raises nothing; the stock log's one trace is the Trainer's fallback warning, which the declared
    signature matches (dspatch.explain)."""
    lines = _warnings(stock[1])
    assert lines and all("stage3_gather_16bit_weights_on_model_save=false" in line for line in lines), lines


@affected
def test_dspatch_env_saves_the_trained_adapter(stock):
    outcome, stderr = verify_patched(PID)  # test_proofs_fixes.py's run
    assert outcome["applied"] == [PID] and outcome["results"] == ALL_OK
    said = [line for line in stderr.splitlines() if line.startswith("dspatch:") and PID in line]
    assert said == [f"dspatch: applied {PID} (transformers {_transformers_version()})"], said
    # the fallback (and its warning) is gone where the adapter is saved; it stays for the model without PEFT
    assert 0 < len(_warnings(stderr)) < len(_warnings(stock[1]))


def _accelerate_runs_two_cpu_ranks():
    from packaging.version import Version

    # accelerate 1.10.1 (mid) runs DeepSpeed with 2 CPU processes under torchrun; 1.15 cannot (both ranks think
    # they are rank 0); 0.34.2 (old) is not relied on here. 1.8.1 with deepspeed 0.16.9 (bridge) can, but in one CI
    # rehearsal one rank's gathered LoRA tensor differed there (a ZeRO-3 gather on 0.16.9 read wrong values once
    # before, in another test): not a reliable check on that stack
    version = upstream.installed_version("accelerate")
    return version is not None and Version("1.10") <= Version(version) < Version("1.15")


@affected
@pytest.mark.skipif(not _accelerate_runs_two_cpu_ranks(), reason="this stack's accelerate cannot run DeepSpeed "
                    "with 2 CPU processes reliably (checked on accelerate 1.10.1)")
def test_two_ranks_gather_together_and_only_main_writes():
    """torchrun, 2 processes, DSPATCH: the adapter reproducers pass on both ranks: the adapter gathered from both
    ranks' partitions (a gather one rank skipped would hang, and the timeout fails the test), rank 0 called
    Trainer._save once per save and rank 1 never, no frozen weight gathered on either rank. The patch's save
    gathers the adapter's parameters at once: deepspeed/zero3-gather-waits-all makes that reliable on gloo."""
    ids = with_gather_fix(PID)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_python(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                       "--master_port", str(port), "-m", "dspatch.verify", PID, "--only", "peft_save_partitioned",
                       "--only", "peft_save_persistent"], env=clean_env(DSPATCH=",".join(ids)), timeout=400)
    # each rank prints one JSON object; the two ranks share the pipe, and one's line can land right after the
    # other's before its newline (seen once in CI): read every object where it starts
    decoder, text = json.JSONDecoder(), proc.stdout
    outcomes = [decoder.raw_decode(text, at)[0] for at in range(len(text)) if text.startswith('{"applied"', at)]
    assert len(outcomes) == 2, proc.stdout[-3000:]
    for outcome in outcomes:
        assert sorted(outcome["applied"]) == sorted(ids), outcome
        assert outcome["results"] == {"peft_save_partitioned": "ok", "peft_save_persistent": "ok"}, outcome


# One interpreter: a throw-away engine first (deepspeed <= 0.16 trains the first engine of a process slightly
# differently), then the two jobs that hit no bug (PEFT with the gather flag on; no PEFT, flag off) stock, then
# dspatch.apply() and the same jobs again: losses, every saved file name and every saved byte/tensor must match.
SAME_AS_STOCK = r'''
import hashlib, json, os, shutil, sys, tempfile
import torch
import dspatch
from dspatch.patches.transformers.peft_zero3_save import reproducers as P
from dspatch.scenario import init_deepspeed, settle
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

deepspeed = init_deepspeed()
settle()
warm = torch.nn.Linear(4, 4)
deepspeed.initialize(model=warm, model_parameters=warm.parameters(), config={
    "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})

def flat(obj, prefix=""):
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in flat(value, f"{prefix}/{i}").items()}
    if isinstance(obj, torch.Tensor):
        return {prefix: [str(obj.dtype), list(obj.shape), obj.detach().flatten().tolist()]}
    if isinstance(obj, (int, float, str, bool, type(None))):
        return {prefix: obj}
    return {prefix: type(obj).__name__}

def saved(folder):
    out = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            key = os.path.relpath(path, folder)
            if name.endswith((".pt", ".pth", ".bin")):
                # pickles: their tensors and plain values (not the bytes, which hold paths and object ids)
                content = flat(torch.load(path, weights_only=False, map_location="cpu"))
                out[key] = {k: v for k, v in content.items() if "ds_version" not in k and "output_dir" not in k
                            and "logging_dir" not in k}
            else:
                out[key] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out

def job(peft, gather):
    folder = tempfile.mkdtemp(prefix="dspatch-peft-same-")
    trainer, _ = P._train(folder, peft=peft, gather=gather, save_steps=2)
    trainer.save_model(os.path.join(folder, "final"))
    unset_hf_deepspeed_config()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    losses.append(trainer.state.log_history[-1]["train_loss"])
    files = saved(folder)
    shutil.rmtree(folder)
    return {"losses": losses, "files": files}

report = {}
for when in ("stock", "patched"):
    if when == "patched":
        assert dspatch.apply(["transformers/peft-zero3-save"])["transformers/peft-zero3-save"][0] == "applied"
    report[when] = {"peft, flag on": job(True, True), "no peft, flag off": job(False, False)}
print("R " + json.dumps(report))
'''


@affected
def test_jobs_that_hit_no_bug_save_bit_identical_files():
    proc = run_python(["-c", SAME_AS_STOCK], env=clean_env(), warm="stack")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    for case, stock in report["stock"].items():
        patched = report["patched"][case]
        assert sorted(patched["files"]) == sorted(stock["files"]), case
        assert patched == stock, case
    assert "final/adapter_model.safetensors" in report["stock"]["peft, flag on"]["files"]
    assert any(f.startswith("final/global_step2/") for f in report["stock"]["no peft, flag off"]["files"])


@pytest.mark.skipif(VERDICT.verdict != gating.FIXED_UPSTREAM, reason="transformers < 5: the patched stacks' tests")
def test_fixed_upstream_saves_the_adapter_but_gathers_frozen_weights():
    """transformers >= 5.0 (PR 41416) with this stack's deepspeed: the same reproducers pass every check of the
    adapter, its loading and the files, then show that upstream's fix gathers each frozen weight whole (DeepSpeed's
    _zero3_consolidated_16bit_state_dict gathers a module's parameters before it drops the frozen ones); DSPATCH=1
    leaves transformers alone."""
    outcome = verify(PID, clean_env(DSPATCH="1"))
    assert PID not in outcome["applied"]
    results = outcome["results"]
    assert results["peft_gather_flag_on"] == "ok" and results["no_peft_unchanged"] == "ok", results
    for name in ("peft_save_partitioned", "peft_save_persistent"):
        assert results[name].startswith(FROZEN_GATHERED), results[name][:500]


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

PEFT_SAVE = registry.all_patches()["transformers/peft-zero3-save"]
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


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_peft_save_the_branch_is_in_every_affected_release_and_gone_in_the_fix():
    for version in RELEASES["transformers/peft-zero3-save"]:
        source = member("transformers", version, "src/transformers/trainer.py").decode()
        assert source.count(BRANCH) == (0 if Version(version) >= Version("5.0.0") else 1), version
    root, _ = _tree("transformers/peft-zero3-save", "5.0.0")  # PR 41416 changed exactly that branch
    (relative,) = PEFT_SAVE.diffs.values()
    check = subprocess.run(["git", "apply", "--check", os.path.join(data_dir("upstream_prs"), relative)], cwd=root,
                           capture_output=True)
    assert check.returncode != 0
    removed, _ = changed_lines(diff_text(relative))
    assert removed == ["                state_dict = self.accelerator.get_state_dict(self.deepspeed)"]


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_peft_save_signatures_match_the_stock_warning_only():
    line = (" stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use"
            " zero_to_fp32.py to recover weights")
    assert line.strip() in BRANCH.replace('"\n                    "', "")  # the Trainer's own words
    peft = "trainable params: 8,192 || all params: 1,240,064 || trainable%: 0.6606"  # peft's print_trainable_parameters
    assert named(f"{peft}\n{line}", PEFT_SAVE)
    assert not named(line, PEFT_SAVE)  # a full model at ZeRO-3 logs it too, and is saved right
    for other in ("ValueError: Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` "
                  "in DeepSpeed config is False.", "Saving model checkpoint to out/checkpoint-2"):
        assert not named(other, PEFT_SAVE)
