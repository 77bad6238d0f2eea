"""deepspeed/zero3-allreduce-fetch-padding beyond the shared proofs: the default all-gather fetch (what a job that
hits no bug runs) is stock's to the bit with every patch active, its losses and weights on both ranks; the shared
proof compares the fixed all-reduce fetch with it, so it must not move."""
import pytest

from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-allreduce-fetch-padding"

RUN = r'''
import json
from dspatch import _runtime
from dspatch.patches.deepspeed.zero3_allreduce_fetch_padding.reproducers import run

ranks = run("all_gather")
print(json.dumps({"applied": _runtime.applied_ids(), "ranks": ranks}))
'''


def test_the_all_gather_fetch_is_stocks_with_every_patch_active():
    runs = stock_and_patched([PID], RUN, {"DSPATCH": "1"}, "every_patch")
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    assert all(r["padded"] and r["error"] is None and len(r["losses"]) == 3 for r in stock["ranks"])
    assert patched["ranks"] == stock["ranks"]
