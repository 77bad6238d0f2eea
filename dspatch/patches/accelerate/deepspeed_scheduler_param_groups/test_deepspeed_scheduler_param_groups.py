"""accelerate/deepspeed-scheduler-param-groups against the real accelerate + deepspeed of this stack (nox sessions
old, bridge, mid, latest: accelerate 0.34.2, 1.8.1, 1.10.1, 1.15.0; all affected, the bug is open upstream).

Stock reproduces exactly (torch 2.13: the first scheduler.step() raises zip()'s ValueError, for a LambdaLR and for
a SequentialLR of two schedulers); DSPATCH=<id> makes every group's learning rate at every step that of the same
optimizer and scheduler without DeepSpeed; the upstream diff applied to a copy of the installed accelerate does
the same with no monkeypatch; a job whose optimizer has no empty group stays stock (losses and learning rates
bit-identical, the scheduler's lists untouched). Leaving out the target and drifting it: test_proofs.py.
"""
import json

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import clean_env, run_python, verify
from upstream_releases import diff_text

pytestmark = pytest.mark.stack

PID = "accelerate/deepspeed-scheduler-param-groups"
PATCH = registry.all_patches()[PID]
ZIP = "ValueError: zip() argument 2 is longer than argument 1"
STOCK = {"empty_middle_group_lambda": f"bug: scheduler.step() 0: {ZIP}",
         "empty_middle_group_sequential": f"bug: scheduler.step() 1: {ZIP}"}
ALL_OK = {name: "ok" for name in PATCH.scenarios}


def _version():
    return upstream.installed_version("accelerate")


def test_this_stack_is_covered():
    assert gating.evaluate(PATCH).verdict == gating.APPLIES


def test_stock_upstream_reproduces_exactly():
    outcome = verify(PID, clean_env())
    assert outcome["applied"] == [] and outcome["results"] == STOCK


# One interpreter: stock first, then dspatch.apply() (late: accelerate is imported already). A job whose optimizer
# has no empty group must not change at all; with the empty group, the scheduler's state after prepare holds the
# kept groups' entries, in order, and round-trips through state_dict.
OBSERVE = r'''
import json
import torch
import dspatch
from dspatch.patches.accelerate.deepspeed_scheduler_param_groups import reproducers as A

report = {}
def job(name, make, empty):
    seen = {}
    def observe(optimizer, scheduler, prepared):
        seen["same lists"] = all(vars(scheduler)[k] is v for k, v in lists.items())
        seen["base_lrs"] = list(scheduler.base_lrs)
        seen["wrapped"] = prepared.scheduler is scheduler
    lists = {}
    def make_and_keep(optimizer):
        scheduler = make(optimizer)
        lists.update({k: v for k, v in vars(scheduler).items() if isinstance(v, list)})
        return scheduler
    lrs, losses = A.with_deepspeed(make_and_keep, empty=empty, observe=observe)
    report[name] = {"lrs": lrs, "losses": losses, **seen}

A.with_deepspeed(A.warmup_lambda, empty=False)  # deepspeed <= 0.16 trains the first engine of a process differently
job("stock", A.warmup_lambda, False)
report["late apply"] = dspatch.apply(["accelerate/deepspeed-scheduler-param-groups"], strict=True)["accelerate/deepspeed-scheduler-param-groups"][0]
job("patched", A.warmup_lambda, False)
job("patched, empty group", A.warmup_lambda, True)
print("R " + json.dumps(report))
'''


def test_no_empty_group_stays_stock_and_the_kept_entries_stay_in_order():
    proc = run_python(["-c", OBSERVE], warm="stack")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    stock, patched, empty = report["stock"], report["patched"], report["patched, empty group"]
    assert report["late apply"] == gating.APPLIED
    assert patched["losses"] == stock["losses"] and patched["lrs"] == stock["lrs"]  # bit-identical
    assert stock["same lists"] and patched["same lists"] and patched["wrapped"]
    assert patched["base_lrs"] == stock["base_lrs"] == [1e-2, 1e-3]
    # the empty middle group (lr 5e-2) is gone from the scheduler: the others keep their own rates
    assert empty["base_lrs"] == [1e-2, 1e-3] and empty["wrapped"]
    assert empty["lrs"] == patched["lrs"]


def test_realign_helper_leaves_other_cases_alone():
    """The shared helper: nothing to do when no group left, or when the optimizer's groups were rebuilt (not a
    subset of the remembered ones); nested schedulers are re-aligned too."""
    code = r'''
import torch
from dspatch.patches import scheduler_param_groups as G
p = [torch.nn.Parameter(torch.ones(1)) for _ in range(3)]
opt = torch.optim.SGD([{"params": [p[0]], "lr": 1.0}, {"params": [p[1]], "lr": 2.0}, {"params": [p[2]], "lr": 3.0}])
sched = torch.optim.lr_scheduler.SequentialLR(opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2),
                                                    torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)], [2])
before = G.remember(sched)
out = [G.realign(sched, before)]
opt.param_groups[:] = [dict(g) for g in before][:2]  # rebuilt, one fewer: not DeepSpeed's pruning
out.append(G.realign(sched, before))
opt.param_groups[:] = [before[0], before[2]]  # the middle one removed in place, as DeepSpeed does
out.append(G.realign(sched, before))
out.append([s.base_lrs for s in sched._schedulers])
sched.step(); sched.step(); sched.step()
out.append([g["lr"] for g in opt.param_groups])
print("R", out)
'''
    out = [line for line in run_python(["-c", code], warm="stack").stdout.splitlines() if line.startswith("R ")][-1]
    assert out == "R [None, None, [0, 2], [[1.0, 3.0], [1.0, 3.0]], [0.9, 2.7]]", out


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_scheduler_param_groups_diffs_add_the_realignment():
    patch = registry.all_patches()["accelerate/deepspeed-scheduler-param-groups"]
    assert patch.diff_for("1.15.0") == "accelerate/0001-deepspeed-scheduler-param-groups-1.12.0-1.15.0.patch"  # to forward
    for relative in patch.diffs.values():
        text = diff_text(relative)
        for field in ("Bug: https://github.com/huggingface/transformers/pull/43692",
                      "+def realign_scheduler_param_groups(scheduler, groups_before):",
                      "+                        realign_scheduler_param_groups(scheduler, scheduler_param_groups)"):
            assert field in text, (relative, field)
