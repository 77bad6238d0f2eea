"""`Accelerator.prepare(model, optimizer, scheduler)` with DeepSpeed: the torch scheduler follows the groups kept.

`deepspeed.initialize` removes empty param groups from the client optimizer in place (a LoRA-style job whose no-decay
group is all frozen, a group for a module that has no trainable parameters). accelerate hands the user's torch
scheduler, built on that optimizer before, to `AcceleratedScheduler` unchanged, so it still has one `base_lrs` /
`lr_lambdas` entry per *original* group: on torch >= 2.10 the first `scheduler.step()` raises `ValueError: zip()
argument 2 is longer than argument 1`; on older torch the lists are truncated, so when the removed group is not the last
one every later group silently gets another group's learning rate. This is the path of custom loops; the Trainer builds
its scheduler too early by another path (transformers/trainer-scheduler-after-deepspeed, transformers#43692). Seen with
accelerate 1.15.0 (latest) + deepspeed 0.19.8 and accelerate 1.10.1 + deepspeed 0.16.3; still open in accelerate 1.15
(related upstream: DeepSpeedExamples PR 756).

The fix: `Accelerator._prepare_deepspeed` is wrapped (one check per `prepare` call, nothing per step): before it runs,
the param groups each torch scheduler among the prepared objects was built on are remembered; after it, the entries of
the groups DeepSpeed removed are dropped from the scheduler, matched by the groups' identity, nested schedulers
(`SequentialLR`) included (dspatch.patches.scheduler_param_groups, the one place that re-aligns). When no group was
removed nothing is touched. Schedulers DeepSpeed builds itself (`DummyScheduler`, a scheduler in the DeepSpeed config)
are built on the pruned optimizer already and are left alone. Tested: each learning rate of every group at every step
equals a run without DeepSpeed. The upstream form, `upstream_prs/accelerate/0001-*.patch`, does the same inside
`_prepare_deepspeed` with a helper in `accelerate/utils/deepspeed.py`.

Not a bug of this kind: SimpleTuner issue 962 (`'Trainer' object has no attribute 'optimizer'` with an optimizer from
the DeepSpeed config) needs no patch: it was a one-line bug in SimpleTuner's own trainer, only in its git tag v1.0
(fixed in v1.0.1, in no PyPI release). What such accelerate loops can still hit is the param-group mismatch above.
"""
from dspatch.spec import Patch, Signature

PID = "accelerate/deepspeed-scheduler-param-groups"
MODULE = "accelerate.accelerator"
QUALNAME = "Accelerator._prepare_deepspeed"

# every release 0.34.0-1.15.0 (tests/test_releases.py recomputes them)
FINGERPRINTS = {
    "1d49bcac810166d4": "0.34.0-0.34.2", "23ef336f9b8dadce": "1.0.0-1.0.1", "c7be814f177e6676": "1.1.0-1.1.1",
    "594e9ce52cf1f586": "1.2.0-1.3.0", "964e2e06fe6b9e01": "1.4.0", "b89b980a86ecf24d": "1.5.0-1.5.2",
    "84a6315ca8c39dab": "1.6.0", "e3a169fd2efb2338": "1.7.0", "b042ba2bd4cf729f": "1.8.0-1.8.1",
    "74ccdda66f159504": "1.9.0-1.11.0", "3435112598fde91d": "1.12.0", "3d4fd221002236b1": "1.13.0-1.14.0",
    "0bb61e9f116e1147": "1.15.0",
}

ZIP = "zip() argument 2 is longer than argument 1"


def _is_torch_scheduler(obj):
    import torch

    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


def _prepare_deepspeed(wrapped, instance, args, kwargs):
    from dspatch.patches import scheduler_param_groups as groups

    remembered = [(obj, groups.remember(obj)) for obj in args if _is_torch_scheduler(obj)]
    result = wrapped(*args, **kwargs)
    for scheduler, before in remembered:
        groups.realign(scheduler, before)
    return result


def apply(txn):
    txn.wrap(txn.target(QUALNAME), _prepare_deepspeed)


PATCH = Patch(
    id=PID,
    summary=("Accelerator.prepare with DeepSpeed and a torch LR scheduler: the scheduler follows the param groups "
             "DeepSpeed kept (no zip() ValueError, no learning rate shifted to another group)"),
    cause=("accelerate keeps the torch scheduler on the optimizer's original param groups after DeepSpeed "
           "dropped some"),
    symptom="`ValueError: zip() argument 2 is longer than argument 1`; older torch: shifted LRs",
    distribution="accelerate",
    affected=">=0",  # open upstream: the fingerprints decide
    fixed_in=None,
    targets={(MODULE, QUALNAME): FINGERPRINTS},
    apply=apply,
    supported=">=0.34.0",
    links=("https://github.com/huggingface/transformers/pull/43692",
           "https://github.com/deepspeedai/DeepSpeedExamples/pull/756"),
    # one diff per band of releases whose files differ around the change; the last is the one to forward
    diffs=("accelerate/0001-deepspeed-scheduler-param-groups-0.34.0-0.34.2.patch",
           "accelerate/0001-deepspeed-scheduler-param-groups-1.0.0-1.0.1.patch",
           "accelerate/0001-deepspeed-scheduler-param-groups-1.1.0-1.4.0.patch",
           "accelerate/0001-deepspeed-scheduler-param-groups-1.5.0-1.11.0.patch",
           "accelerate/0001-deepspeed-scheduler-param-groups-1.12.0-1.15.0.patch"),
    # the Trainer's loop gives the same message (transformers/trainer-scheduler-after-deepspeed): its frames decide
    signatures=(Signature(r"zip\(\) argument 2 is longer than argument 1", error="ValueError", needs=(r"lr_scheduler",),
                          hints=(r"accelerate[/\\]scheduler\.py",), unless=(r"transformers[/\\]trainer\.py",),
                          tell="no frame of transformers/trainer.py: your own loop steps a torch scheduler given to "
                               "accelerator.prepare with DeepSpeed"),),
    note=("open upstream: gated by the source of Accelerator._prepare_deepspeed. Wrapped: per prepare() call it "
          "remembers the param groups of each torch scheduler passed in and drops the entries of the groups "
          "DeepSpeed removed; nothing per step"),
)
