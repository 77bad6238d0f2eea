"""deepspeed/zero3-moe-leaf-modules beyond the shared proofs (mid: deepspeed 0.16.3, transformers 4.57.6): the user's
choice wins. Leaves the user set by hand stay theirs, with every patch active the job is stock's to the bit; and
DSPATCH_DISABLE leaves the patch out (the ranks diverge again, as on stock)."""
import pytest

from conftest import clean_env, last_json, run_python

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-moe-leaf-modules"

RUN = r'''
import json, sys
from dspatch import _runtime
from dspatch.patches.deepspeed.zero3_moe_leaf_modules_reproducers import run

print(json.dumps({"applied": _runtime.applied_ids(), "ranks": run(sys.argv[1])}))
'''


def _run(mode, **env):
    return last_json(run_python(["-c", RUN, mode], env=clean_env(**env), warm="stack"))


@pytest.fixture(scope="module", autouse=True)
def applies_here():
    from dspatch import gating, registry

    if gating.evaluate(registry.all_patches()[PID]).verdict != gating.APPLIES:
        pytest.skip(f"{PID} does not apply to this stack")


def test_leaves_set_by_hand_stay_the_users_with_every_patch_active():
    stock, patched = _run("by_hand"), _run("by_hand", DSPATCH="1")
    assert stock["applied"] == [] and PID in patched["applied"]
    assert isinstance(stock["ranks"], list) and stock["ranks"][0]["hit"] != stock["ranks"][1]["hit"]
    assert patched["ranks"] == stock["ranks"]


def test_dspatch_disable_leaves_it_out():
    left_out = _run("", DSPATCH="1", DSPATCH_DISABLE=PID)
    assert PID not in left_out["applied"]
    assert isinstance(left_out["ranks"], str) and " exited -6:" in left_out["ranks"]  # gloo's abort, as on stock
