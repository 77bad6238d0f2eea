"""transformers/trainer-scheduler-after-deepspeed against the real Trainer + accelerate + deepspeed of this stack
(nox sessions old, bridge, mid: transformers 4.44.2, 4.46.3, 4.57.6; latest has 5.23.0, fixed upstream).

Each reproducer compares the learning rate of every param group at every step (6 steps, linear warm-up over 4)
with the same Trainer without DeepSpeed. Stock reproduces exactly (torch 2.13: zip()'s ValueError at the first
lr_scheduler.step() when the no-decay group is empty, also in the run that writes the checkpoint to resume from),
while the optimizer/scheduler from the DeepSpeed config (DummyOptim / DummyScheduler) already work; DSPATCH=<id>
fixes both, resuming included; the upstream diff (the backport) applied to a copy of the installed transformers does
the same with no monkeypatch; a job that hits no bug stays stock (losses and learning rates bit-identical, with and
without DeepSpeed). 5.1.0's own regression is covered statically (tests/test_gating_*: the transform and the diff
give the same code on 5.1.0's source): 5.1.0 cannot be imported with this project's stacks.
"""
import json

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import clean_env, run_python, verify
from dspatch import data_dir
from test_releases import RELEASES
from test_releases import _tree
from upstream_releases import tree_locate
import ast
import copy
import os
import subprocess

pytestmark = pytest.mark.stack

PID = "transformers/trainer-scheduler-after-deepspeed"
PATCH = registry.all_patches()[PID]
ZIP = "ValueError: zip() argument 2 is longer than argument 1"
STOCK = {"frozen_no_decay_group": f"bug: Trainer.train: lr_scheduler.step(): {ZIP}",
         "optimizer_or_scheduler_from_ds_config": "ok",
         "resume_from_checkpoint": f"bug: Trainer.train: lr_scheduler.step(): {ZIP}"}
ALL_OK = {name: "ok" for name in PATCH.scenarios}


def _version():
    return upstream.installed_version("transformers")


def _applies():
    verdict = gating.evaluate(PATCH).verdict
    if verdict != gating.APPLIES:
        assert verdict == gating.FIXED_UPSTREAM and _version().split(".")[0] == "5", (_version(), verdict)
        pytest.skip(f"transformers {_version()}: {verdict} (5.2.0)")


def test_this_stack_verdict():
    verdict = gating.evaluate(PATCH).verdict
    assert verdict == (gating.FIXED_UPSTREAM if _version().startswith("5.") else gating.APPLIES)


def test_stock_upstream_reproduces_exactly():
    _applies()
    outcome = verify(PID, clean_env())
    assert outcome["applied"] == [] and outcome["results"] == STOCK


# One interpreter: stock, then dspatch.apply() (late: transformers is imported already), then the same jobs again.
OBSERVE = r'''
import json
import dspatch
from dspatch.patches.transformers.trainer_scheduler_after_deepspeed import reproducers as T

def job(deepspeed, freeze_norms=False):
    lrs, losses, trainer = T.run_trainer(deepspeed, freeze_norms=freeze_norms)
    return {"lrs": {str(k): v for k, v in lrs.items()}, "losses": losses,
            "scheduler": type(trainer.lr_scheduler).__name__, "groups": len(trainer.optimizer.param_groups)}

report = {}
T.run_trainer(T.ds_config(), freeze_norms=False)  # deepspeed <= 0.16 trains the first engine of a process differently
def jobs():
    return {"plain": job(None), "zero2": job(T.ds_config()),
            # scheduler (and optimizer) from the DeepSpeed config, with the empty no-decay group
            "ds scheduler": job(T.ds_config(scheduler=True), True),
            "ds optimizer and scheduler": job(T.ds_config(optimizer=True, scheduler=True), True)}

report["stock"] = jobs()
report["late apply"] = dspatch.apply(["transformers/trainer-scheduler-after-deepspeed"], strict=True)["transformers/trainer-scheduler-after-deepspeed"][0]
report["patched"] = jobs()
print("R " + json.dumps(report))
'''


def test_jobs_without_the_bug_stay_stock():
    """Nothing frozen (no empty group), with and without DeepSpeed, and the scheduler (and optimizer) from the
    DeepSpeed config with the empty group: losses and every learning rate bit-identical to stock, the Trainer's
    scheduler the same kind of object."""
    _applies()
    proc = run_python(["-c", OBSERVE], warm="stack")
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])
    assert report["late apply"] == gating.APPLIED
    assert report["patched"] == report["stock"]
    assert report["stock"]["zero2"]["groups"] == 2 and report["stock"]["zero2"]["scheduler"] == "LambdaLR"
    assert report["stock"]["zero2"]["lrs"] == report["stock"]["plain"]["lrs"]
    assert report["stock"]["ds scheduler"]["scheduler"] == "DeepSpeedSchedulerWrapper"


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

SCHEDULER = "transformers/trainer-scheduler-after-deepspeed"


@pytest.mark.unit_only  # released sources only: once, in the unit session
@pytest.mark.parametrize("version", RELEASES[SCHEDULER][:RELEASES[SCHEDULER].index("5.1.0") + 1])
def test_trainer_scheduler_transforms_give_the_code_of_the_bands_diff(version, tmp_path):
    """Parity of the two forms, for every release: the transforms rebuild both targets into the same code (AST)
    as the band's diff applied to the release."""
    from dspatch.patches.transformers import trainer_scheduler_after_deepspeed as fix

    patch = registry.all_patches()[SCHEDULER]
    root, locate = _tree(SCHEDULER, version)
    work = tmp_path / "tree"
    subprocess.run(["cp", "-r", root, str(work)], check=True)
    subprocess.run(["git", "apply", os.path.join(data_dir("upstream_prs"), patch.diff_for(version))], cwd=work,
                   check=True)
    patched = tree_locate(str(work))
    trainer, optim_sched = patch.targets
    for target, transform in ((trainer, fix.transform_trainer), (optim_sched, fix.no_scheduler_on_the_raw_optimizer)):
        node = copy.deepcopy(upstream.definition(locate(target.module), target.qualname))
        if target is optim_sched and not fix.builds_scheduler_before_prepare(node):
            assert version == "5.1.0"  # 5.1.0 builds no scheduler there: left as it is, and the diff leaves it
        else:
            transform(node)
        assert ast.dump(node) == ast.dump(upstream.definition(patched(target.module), target.qualname)), target
