"""accelerate/deepspeed-clip-grad-norm beyond the shared proofs: where nothing asks for another clipping, every patch
active leaves the weights stock's to the bit: a `max_norm` equal to the config's `gradient_clipping` (the Trainer's
call, "auto" filled from max_grad_norm), and a `max_norm` of inf (how the Trainer reads the norm alone)."""
import pytest

from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "accelerate/deepspeed-clip-grad-norm"

RUNS = r'''
import json
from dspatch import _runtime
from dspatch.patches.accelerate.deepspeed_clip_grad_norm.reproducers import CONFIGURED, clipped_loop
from dspatch.scenario import digest

runs = {"equal_zero2": clipped_loop(2, max_norm=CONFIGURED), "inf_zero2": clipped_loop(2, max_norm=float("inf")),
        "equal_zero0": clipped_loop(0, max_norm=0.0, clipping=0.0)}
print(json.dumps({"applied": _runtime.applied_ids(), **{name: digest(w) for name, w in runs.items()}}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": "1"}, "every_patch")


@pytest.mark.parametrize("name", ["equal_zero2", "inf_zero2", "equal_zero0"])
def test_where_nothing_asks_for_another_clipping_the_weights_are_stocks(runs, name):
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    assert patched[name] == stock[name]
