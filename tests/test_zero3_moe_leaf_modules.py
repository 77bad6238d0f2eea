"""deepspeed/zero3-moe-leaf-modules beyond the shared proofs (which run on mid), on ds0183 (deepspeed 0.18.3,
transformers 4.57.6) with Ernie 4.5 MoE, a class DeepSpeed does not mark: the user's choice wins. Leaves the user
set by hand stay theirs (with every patch active the job is stock's to the bit), DSPATCH_DISABLE leaves the patch
out (the ranks diverge again, as on stock), and a config that sets `zero_optimization.leaf_module` itself, to no
class, is obeyed."""
import pytest

from conftest import clean_env, last_json, run_python
from dspatch.patches.deepspeed.zero3_moe_leaf_modules_reproducers import _how_it_failed

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-moe-leaf-modules"

RUN = r'''
import json, sys
import deepspeed.runtime.zero.parameter_offload  # the patches DSPATCH selects apply here, and the ranks inherit them
from dspatch import _runtime
from dspatch.patches.deepspeed.zero3_moe_leaf_modules_reproducers import run

print(json.dumps({"applied": _runtime.applied_ids(), "ranks": run(sys.argv[2], sys.argv[1])}))
'''


def _run(mode, kind="mixtral", **env):
    return last_json(run_python(["-c", RUN, mode, kind], env=clean_env(**env), warm="stack"))


@pytest.fixture(scope="module", autouse=True)
def applies_here():
    from dspatch import gating, registry, upstream
    from dspatch.versions import Version

    if gating.evaluate(registry.all_patches()[PID]).verdict != gating.APPLIES:
        pytest.skip(f"{PID} does not apply to this stack")
    if Version(upstream.installed_version("deepspeed")) < Version("0.18.0"):  # CI time: the shared proofs run here
        pytest.skip("the user's choices are tested on deepspeed >= 0.18.0 (ds0183), where the config's leaf_module "
                    "exists too")


def test_leaves_set_by_hand_stay_the_users_with_every_patch_active():
    stock, patched = _run("by_hand", "ernie"), _run("by_hand", "ernie", DSPATCH="1")
    assert stock["applied"] == [] and PID in patched["applied"]
    assert isinstance(stock["ranks"], list) and stock["ranks"][0]["hit"] != stock["ranks"][1]["hit"]
    assert patched["ranks"] == stock["ranks"]


def test_dspatch_disable_leaves_it_out():
    left_out = _run("", "ernie", DSPATCH="1", DSPATCH_DISABLE=PID)
    assert PID not in left_out["applied"]
    assert isinstance(left_out["ranks"], str) and _how_it_failed(left_out["ranks"]), left_out  # as on stock


def test_a_config_that_sets_leaf_module_itself_is_obeyed():
    obeyed = _run("config_none", "ernie", DSPATCH="1")
    assert PID in obeyed["applied"]
    assert isinstance(obeyed["ranks"], str) and _how_it_failed(obeyed["ranks"]), obeyed  # no leaf: they diverge
