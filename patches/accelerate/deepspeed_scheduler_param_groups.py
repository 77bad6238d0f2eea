"""`Accelerator.prepare(model, optimizer, scheduler)` with DeepSpeed: the torch scheduler follows the param groups
DeepSpeed kept.

`deepspeed.initialize` removes empty param groups from the client optimizer in place (a LoRA-style job whose
no-decay group is all frozen, a group for a module that has no trainable parameters). accelerate hands the
user's torch scheduler, built on that optimizer before, to `AcceleratedScheduler` unchanged, so it still has
one `base_lrs` / `lr_lambdas` entry per *original* group: on torch >= 2.10 the first `scheduler.step()` raises
`ValueError: zip() argument 2 is longer than argument 1`; on older torch the lists are truncated, so when the
removed group is not the last one every later group silently gets another group's learning rate. Seen with
accelerate 1.15.0 (latest) + deepspeed 0.19.8 and accelerate 1.10.1 + deepspeed 0.16.3; not fixed upstream.

The fix: `Accelerator._prepare_deepspeed` is wrapped (one check per `prepare` call, nothing per step): before
it runs, the param groups each torch scheduler among the prepared objects was built on are remembered; after
it, the entries of the groups DeepSpeed removed are dropped from the scheduler (dspatch.patches.
scheduler_param_groups, the one place that re-aligns). When no group was removed nothing is touched.
Schedulers DeepSpeed builds itself (`DummyScheduler`, a scheduler in the DeepSpeed config) are built on the
pruned optimizer already and are left alone. The upstream form, `upstream_prs/accelerate/0001-*.patch`, does
the same inside `_prepare_deepspeed` with a helper in `accelerate/utils/deepspeed.py`.
"""
from dspatch.spec import BugSeen, Patch, Target

PID = "accelerate/deepspeed-scheduler-param-groups"
MODULE = "accelerate.accelerator"
QUALNAME = "Accelerator._prepare_deepspeed"

# every release 0.34.0-1.15.0 (tests/test_gating_accelerate_scheduler_param_groups.py recomputes them)
FINGERPRINTS = {
    "1d49bcac810166d4": "0.34.0-0.34.2", "23ef336f9b8dadce": "1.0.0-1.0.1", "c7be814f177e6676": "1.1.1",
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


# ----------------------------------------------------------------------------------------------------
# Reproducers: a real Accelerator with the DeepSpeed plugin (ZeRO-2, CPU, one process), a tiny model whose
# optimizer has three param groups with their own learning rates, the middle one empty. The learning rate of
# every group at every step must be the one a plain torch run of the same optimizer and scheduler gives.

STEPS = 6


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _groups(model, empty=True):
    """first layer at 1e-2, an empty group at 5e-2 (as a group whose parameters are all frozen), last layer at
    1e-3; `empty=False`: without the empty group."""
    groups = [{"params": list(model[0].parameters()), "lr": 1e-2},
              {"params": [], "lr": 5e-2},
              {"params": list(model[2].parameters()), "lr": 1e-3, "weight_decay": 0.0}]
    return groups if empty else [groups[0], groups[2]]


def warmup_lambda(optimizer):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3) * (1 - step / 20))


def warmup_then_cosine(optimizer):
    import torch

    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(optimizer, [sched.LinearLR(optimizer, start_factor=0.25, total_iters=2),
                                          sched.CosineAnnealingLR(optimizer, T_max=4)], milestones=[2])


def _reference(make_scheduler):
    """[[lr of each non-empty group] per step] of the plain torch run."""
    import torch

    optimizer = torch.optim.AdamW(_groups(_model()))
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(STEPS):
        lrs.append([g["lr"] for g in optimizer.param_groups if g["params"]])
        optimizer.step()
        scheduler.step()
    return lrs


def with_deepspeed(make_scheduler, empty=True, observe=None):
    """([[lr of each group] per step], [losses]) of a ZeRO-2 job prepared by accelerate; `observe(optimizer,
    scheduler, prepared_scheduler)` is called after prepare."""
    import torch

    from dspatch.scenario import init_deepspeed

    init_deepspeed()
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 2}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model, empty))
    scheduler = make_scheduler(optimizer)
    raw = (optimizer, scheduler)
    engine, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if observe is not None:
        observe(*raw, scheduler)
    if type(engine).__name__ != "DeepSpeedEngine":
        raise AssertionError(f"accelerate did not use DeepSpeed: {type(engine).__name__}")
    generator = torch.Generator().manual_seed(1)
    lrs, losses = [], []
    try:
        for step in range(STEPS):
            lrs.append([g["lr"] for g in optimizer.param_groups])
            loss = engine(torch.randn(2, 8, generator=generator)).pow(2).mean()
            losses.append(loss.item())
            accelerator.backward(loss)
            optimizer.step()
            try:
                scheduler.step()
            except ValueError as e:
                if ZIP not in str(e):
                    raise
                raise BugSeen(f"scheduler.step() {step}: ValueError: {e}") from e
            optimizer.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
    return lrs, losses


def _compare(make_scheduler):
    want = _reference(make_scheduler)
    got = with_deepspeed(make_scheduler)[0]
    if got != want:
        step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        raise BugSeen(f"learning rates differ from the same optimizer and scheduler without DeepSpeed from step "
                      f"{step}: {got[step]} != {want[step]}")


def empty_middle_group_lambda():
    """LambdaLR (warm-up) over groups [1e-2, empty, 1e-3]: every kept group follows its own schedule."""
    _compare(warmup_lambda)


def empty_middle_group_sequential():
    """SequentialLR(LinearLR warm-up, CosineAnnealingLR) over the same groups (nested schedulers)."""
    _compare(warmup_then_cosine)


PATCH = Patch(
    id=PID,
    summary=("Accelerator.prepare with DeepSpeed and a torch LR scheduler: the scheduler follows the param groups "
             "DeepSpeed kept (no zip() ValueError, no learning rate shifted to another group)"),
    distribution="accelerate",
    affected=">=0",  # open upstream: the fingerprints decide
    fixed_in=None,
    targets=[Target(MODULE, QUALNAME, FINGERPRINTS)],
    apply=apply,
    supported=">=0.34.0",
    links=("https://github.com/huggingface/transformers/pull/43692",
           "https://github.com/deepspeedai/DeepSpeedExamples/pull/756"),
    # one diff per band of releases whose files differ around the change; the last is the one to forward
    diffs={">=0.34.0,<=0.34.2": "accelerate/0001-deepspeed-scheduler-param-groups-0.34.0-0.34.2.patch",
           ">=1.0.0,<=1.0.1": "accelerate/0001-deepspeed-scheduler-param-groups-1.0.0-1.0.1.patch",
           ">=1.1.1,<=1.4.0": "accelerate/0001-deepspeed-scheduler-param-groups-1.1.1-1.4.0.patch",
           ">=1.5.0,<=1.11.0": "accelerate/0001-deepspeed-scheduler-param-groups-1.5.0-1.11.0.patch",
           ">=1.12.0,<=1.15.0": "accelerate/0001-deepspeed-scheduler-param-groups.patch"},
    scenarios={"empty_middle_group_lambda": empty_middle_group_lambda,
               "empty_middle_group_sequential": empty_middle_group_sequential},
    expected_on_stock={"empty_middle_group_lambda": f"scheduler.step() 0: ValueError: {ZIP}",
                       "empty_middle_group_sequential": f"ValueError: {ZIP}"},
    signatures=(r"ValueError: zip\(\) argument 2 is longer than argument 1",),
    note=("open upstream: gated by the source of Accelerator._prepare_deepspeed. Wrapped: per prepare() call it "
          "remembers the param groups of each torch scheduler passed in and drops the entries of the groups "
          "DeepSpeed removed; nothing per step"),
)
