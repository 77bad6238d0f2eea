"""accelerate/deepspeed-ga-boundary beyond the shared proofs: where accelerate's windows and DeepSpeed's own count agree,
every patch active leaves the weights stock's to the bit: a dataloader whose length the accumulation divides, at ZeRO-2
and ZeRO-1, a loop without `accelerator.accumulate` (no one sets sync_gradients: DeepSpeed keeps counting, where
accelerate 1.8.0 would step on every micro-step), and a GA set in the DeepSpeed config alone (accelerate < 1.8 counts 1
itself: DeepSpeed's count is the one the job means)."""
import pytest


from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "accelerate/deepspeed-ga-boundary"

RUNS = r'''
import json
from dspatch import _runtime
from dspatch.patches.accelerate.deepspeed_ga_boundary.reproducers import GA, accelerate_loop
from dspatch.scenario import digest

runs = {"divides_zero2": accelerate_loop(batches=GA), "divides_zero1": accelerate_loop(batches=GA, stage=1),
        "no_accumulate": accelerate_loop(accumulate=False), "ga_in_deepspeed_config_only": accelerate_loop(accelerators_ga=1)}
print(json.dumps({"applied": _runtime.applied_ids(), **{name: digest(w) for name, w in runs.items()}}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": "1"}, "every_patch")


@pytest.mark.parametrize("name", ["divides_zero2", "divides_zero1", "no_accumulate", "ga_in_deepspeed_config_only"])
def test_where_both_counts_agree_every_patch_leaves_the_weights_stocks(runs, name):
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    assert patched[name] == stock[name]
