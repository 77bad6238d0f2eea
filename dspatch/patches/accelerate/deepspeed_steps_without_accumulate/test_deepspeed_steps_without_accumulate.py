"""accelerate/deepspeed-steps-without-accumulate beyond the shared proofs: where the job decides its boundaries, or
where both counts agree, every patch active leaves the weights stock's to the bit: a loop under
`accelerator.accumulate` (ZeRO-2 and ZeRO-1), and a loop without it at accumulation 1."""
import pytest

from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "accelerate/deepspeed-steps-without-accumulate"

RUNS = r'''
import json
from dspatch import _runtime
from dspatch.patches.accelerate.deepspeed_steps_without_accumulate.reproducers import BATCHES, config
from dspatch.scenario import accelerate_sgd_loop, digest, lm_batches

batches = lm_batches(BATCHES)
runs = {"accumulate_zero2": accelerate_sgd_loop(config(), batches),
        "accumulate_zero1": accelerate_sgd_loop(config(stage=1), batches),
        "no_accumulate_ga1": accelerate_sgd_loop(config(ga=1), batches, accumulate=False)}
print(json.dumps({"applied": _runtime.applied_ids(), **{name: digest(w) for name, w in runs.items()}}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": "1"}, "every_patch")


@pytest.mark.parametrize("name", ["accumulate_zero2", "accumulate_zero1", "no_accumulate_ga1"])
def test_where_the_job_decides_or_both_counts_agree_the_weights_are_stocks(runs, name):
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    assert patched[name] == stock[name]
