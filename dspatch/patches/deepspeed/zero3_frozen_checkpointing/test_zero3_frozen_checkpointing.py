"""deepspeed/zero3-frozen-checkpointing against the real deepspeed (transformers, peft) of this stack.

Stock reproduces the CheckpointError exactly (plain deepspeed.initialize + torch.utils.checkpoint, and a Trainer
with a LoRA Llama); DSPATCH fixes it, with losses and trained weights bit-identical to reentrant checkpointing and
to no checkpointing ("equal" here means bit-identical: the recompute runs the same ops on the same gathered
weights); the upstream diff applied to a copy of the installed deepspeed does the same with no monkeypatch; runs
that hit no bug (no checkpointing, reentrant) are bit-identical to stock; and it applies together with
deepspeed/zero3-module-id where both apply.
"""
import json

import pytest

from dspatch import gating, registry

from conftest import clean_env, deepspeed_version, run_python, verify

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-frozen-checkpointing"
MODULE_ID = "deepspeed/zero3-module-id"
PATCH = registry.all_patches()[PID]
ALL_OK = {name: "ok" for name in PATCH.scenarios}
BUG = ("bug: CheckpointError: Recomputed values for the following tensors have different metadata than during the "
       "forward pass (a frozen weight partitioned during the recompute)")


def _applies():
    return gating.evaluate(PATCH).verdict == gating.APPLIES


def test_verdict_on_this_stack():
    verdict = gating.evaluate(PATCH).verdict
    if not _applies():
        assert verdict == gating.FIXED_UPSTREAM, verdict  # latest: deepspeed 0.19.8 has upstream's fix
        pytest.skip(f"deepspeed {deepspeed_version()}: fixed upstream (0.19.3)")


def test_stock_upstream_reproduces_exactly():
    outcome = verify(PID, clean_env())
    if not _applies():
        assert outcome["results"] == ALL_OK  # upstream's own fix trains
        return
    assert outcome["applied"] == [] and outcome["results"] == dict.fromkeys(PATCH.scenarios, BUG)


def test_together_with_zero3_module_id():
    other = registry.all_patches()[MODULE_ID]
    if not _applies() or gating.evaluate(other).verdict != gating.APPLIES:
        pytest.skip("deepspeed/zero3-module-id does not apply on this stack")
    proc = run_python(["-m", "dspatch.verify", PID], env=clean_env(DSPATCH=f"{PID},{MODULE_ID}"), warm="stack")
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(outcome["applied"]) == {PID, MODULE_ID} and outcome["results"] == ALL_OK


# Runs that hit no bug: no checkpointing and reentrant checkpointing, stock, then with the patch applied (late,
# in the same interpreter, on fresh engines): losses and final parameters bit-identical.
OBSERVE = r'''
import json, torch
import dspatch
from dspatch.patches.deepspeed.zero3_frozen_checkpointing import reproducers as Z
def run():
    out = {}
    for mode in (None, True):
        losses, params = Z.train_plain(mode, steps=2, accumulation=2)
        out[str(mode)] = (losses, {n: p.flatten().tolist() for n, p in params.items()})
    return out
stock = run()
verdict = dspatch.apply(["deepspeed/zero3-frozen-checkpointing"], strict=True)["deepspeed/zero3-frozen-checkpointing"][0]
patched = run()
print(json.dumps({"verdict": verdict, "same": {m: stock[m] == patched[m] for m in stock},
                  "losses": {m: stock[m][0] for m in stock}}))
'''


def test_runs_without_recompute_of_frozen_weights_are_bit_identical_to_stock():
    if not _applies():
        pytest.skip("fixed upstream on this stack")
    proc = run_python(["-c", OBSERVE], env=clean_env(), warm="stack")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["verdict"] == "applied" and report["same"] == {"None": True, "True": True}, report
    assert report["losses"]["None"] == report["losses"]["True"]  # and reentrant equals no checkpointing


# Beyond "no worse than trainable weights" (the accumulation scenario): like upstream's release_backward_leftovers,
# the end of each backward pass releases the frozen weights the recompute kept gathered whose submodule backward
# never ran. Left gathered, on every release, are only the weights of a block's last module, where torch stops
# the recompute early (inside that module's forward, before its forward release: stock leaves any weight there
# gathered, frozen or not) when that module's own backward release does not run either (0.16.0-0.16.7, whose
# pending-gradient count grows at each recompute).
SWEEP = r'''
import json
from dspatch.patches.deepspeed.zero3_frozen_checkpointing import reproducers as Z
frozen = {n for n, p in Z._model().named_parameters() if not p.requires_grad}
gathered = []
Z.train_plain(False, steps=2, accumulation=2, gathered=gathered)
print(json.dumps([sorted(g & frozen) for g in gathered]))
'''


def test_frozen_weights_released_at_the_end_of_each_backward():
    if not _applies():
        pytest.skip("fixed upstream on this stack")
    proc = run_python(["-c", SWEEP], env=clean_env(DSPATCH=PID), warm="stack")
    left = json.loads(proc.stdout.strip().splitlines()[-1])
    from packaging.version import Version

    grows = Version("0.16.0") <= Version(deepspeed_version()) <= Version("0.16.7")
    expected = ["blocks.0.post.weight", "blocks.1.post.weight"] if grows else []
    assert left == [expected] * 4, left
