"""deepspeed/pipe-grad-accum-scale beyond the shared proofs (the ds0183 session, deepspeed 0.18.3): where the bug
cannot happen, every patch active leaves a pipeline's weights stock's to the bit: a one-stage pipeline at accumulation
3 (its only stage is the last, which divides once) and a 2-stage one at accumulation 1 (nothing to divide)."""
import pytest

from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "deepspeed/pipe-grad-accum-scale"

RUNS = r'''
import json
from dspatch import _runtime
from dspatch.patches.deepspeed.grad_accum_scale_no_allreduce.reproducers import pipeline_weights
from dspatch.patches.deepspeed.pipe_grad_accum_scale.reproducers import pipeline_run
from dspatch.scenario import digest

_, record, _ = pipeline_run(accumulation=1)
last = record["steps"][-1]["weights"]
runs = {"one_stage": pipeline_weights(), "two_stages_ga1": {name: last[name] for name in sorted(last)}}
print(json.dumps({"applied": _runtime.applied_ids(), **{name: digest(w) for name, w in runs.items()}}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": "1"}, "every_patch")


@pytest.mark.parametrize("name", ["one_stage", "two_stages_ga1"])
def test_where_one_division_is_right_every_patch_leaves_the_weights_stocks(runs, name):
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    assert patched[name] == stock[name]
