"""deepspeed/lr-schedules-multigroup beyond the shared proofs (old, mid, bridge, ds0183): where the bug cannot happen,
every patch active leaves the rates and the weights stock's to the bit: WarmupLR with `warmup_max_lr` set (a number,
so every group's peak is that number, by design), WarmupDecayLR (its own default 0.001, kept on every release), and
WarmupCosineLR and WarmupLR with `warmup_max_lr` unset on a single param group (on 0.17.2 and later, where the
default is group 0's rate; before, the default 0.001 is the bug's first half)."""
import pytest

from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "deepspeed/lr-schedules-multigroup"

RUNS = r'''
import json
import deepspeed
from dspatch import _runtime
from dspatch.patches.deepspeed.lr_schedules_multigroup.reproducers import COSINE, WARMUP, deepspeed_run
from dspatch.scenario import digest
from dspatch.versions import Version

runs = {"warmup_max_set": ({"type": "WarmupLR", "params": {**WARMUP, "warmup_max_lr": 0.05}}, False),
        "warmup_decay": ({"type": "WarmupDecayLR", "params": {**WARMUP, "warmup_min_lr": 0.0, "total_num_steps": 6}},
                         False),
        "cosine_one_group": ({"type": "WarmupCosineLR", "params": COSINE}, True)}
if Version(Version(deepspeed.__version__).base_version) >= Version("0.17.2"):
    runs["warmup_one_group"] = ({"type": "WarmupLR", "params": WARMUP}, True)
out = {}
for name, (scheduler, one_group) in runs.items():
    rates, weights = deepspeed_run(scheduler, one_group=one_group)
    out[name] = [rates, digest(weights)]
print(json.dumps({"applied": _runtime.applied_ids(), **out}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": "1"}, "every_patch")


@pytest.mark.parametrize("name", ["warmup_max_set", "warmup_decay", "cosine_one_group", "warmup_one_group"])
def test_where_the_groups_cannot_differ_every_patch_leaves_rates_and_weights_stocks(runs, name):
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    if name not in stock:
        pytest.skip("before 0.17.2 an unset warmup_max_lr is 0.001: the bug's first half")
    assert patched[name] == stock[name]
    assert len({tuple(step) for step in stock[name][0]}) > 2  # the schedule moved the rates: a real run
