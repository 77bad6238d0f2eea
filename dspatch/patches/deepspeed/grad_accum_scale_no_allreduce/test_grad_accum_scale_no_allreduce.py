"""deepspeed/grad-accum-scale-no-allreduce beyond the shared proofs: where no backward skips the all-reduce (no
`no_sync`, no pipeline) or nothing is accumulated, the patch leaves the weights stock's to the bit (this patch alone:
on 0.18.2 another one rightly changes ZeRO-2 with accumulation): the raw loop
at ZeRO-1 and ZeRO-2 without `no_sync`, and a pipeline at accumulation 1. And the fix lands where the same loop without
`no_sync` does (within the reproducers' tolerance)."""
import json

import pytest


from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "deepspeed/grad-accum-scale-no-allreduce"

RUNS = r'''
import json
from dspatch import _runtime
from dspatch.patches.deepspeed.grad_accum_scale_no_allreduce.reproducers import engine_loop, pipeline_weights
from dspatch.patches.deepspeed.output_hooks_gas_per_tensor.reproducers import RTOL
from dspatch.scenario import digest, worst

plain = engine_loop(no_sync=False)
runs = {"zero1": plain, "zero2": engine_loop(stage=2, no_sync=False), "pipeline_ga1": pipeline_weights(1)}
off = worst(engine_loop(), plain)
print(json.dumps({"applied": _runtime.applied_ids(), "no_sync_off": off, "rtol": RTOL,
                  **{name: digest(w) for name, w in runs.items()}}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": PID})


@pytest.mark.parametrize("name", ["zero1", "zero2", "pipeline_ga1"])
def test_where_every_backward_reduces_the_patch_leaves_the_weights_stocks(runs, name):
    stock, patched = runs["stock"], runs["patched"]
    assert stock["applied"] == [] and PID in patched["applied"]
    assert patched[name] == stock[name]


def test_the_fixed_no_sync_loop_lands_where_the_loop_without_no_sync_does(runs):
    assert runs["patched"]["no_sync_off"] <= runs["patched"]["rtol"], json.dumps(runs["patched"])
    assert runs["stock"]["no_sync_off"] > 0.5  # the undivided micro-steps: far off
