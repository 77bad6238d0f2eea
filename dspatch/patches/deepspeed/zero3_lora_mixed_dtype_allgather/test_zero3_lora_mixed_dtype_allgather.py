"""deepspeed/zero3-lora-mixed-dtype-allgather beyond the shared proofs (ds0192: deepspeed 0.19.2): where every
parameter has one dtype (a bf16 model without adapters) the fix has nothing to do, and with every patch active the
2-rank job equals, to the bit, its losses and weights on both ranks, the job with deepspeed/zero3-gather-waits-all
alone (stock itself is not reproducible there: 0.19.2's gather of several parameters can read one early on gloo)."""
import pytest

from conftest import clean_env, last_json, run_python, skip_unless_applies

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-lora-mixed-dtype-allgather"
GATHER = "deepspeed/zero3-gather-waits-all"

RUN = r'''
import json
import deepspeed.runtime.zero.partition_parameters  # the patches DSPATCH selects apply here, and the ranks inherit them
from dspatch.patches.deepspeed.zero3_lora_mixed_dtype_allgather.reproducers import run

print(json.dumps({"ranks": run("bf16")}))
'''


def test_one_dtype_trains_as_without_it_with_every_patch_active():
    skip_unless_applies(PID)
    alone, every = (last_json(run_python(["-c", RUN], env=clean_env(DSPATCH=value), warm="stack"))["ranks"]
                    for value in (GATHER, "1"))
    assert all(r["applied"] == [GATHER] for r in alone) and all(PID in r["applied"] for r in every)
    assert all(r["error"] is None and r["dtypes"] == ["torch.bfloat16"] and r["moved"] == r["count"] > 0
               for r in alone)
    assert [{**r, "applied": None} for r in every] == [{**r, "applied": None} for r in alone]
