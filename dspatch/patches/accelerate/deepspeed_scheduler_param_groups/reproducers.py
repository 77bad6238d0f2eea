"""Reproducers: a real Accelerator with the DeepSpeed plugin (ZeRO-2, CPU, one process), a tiny model whose
optimizer has three param groups with their own learning rates, the middle one empty. The learning rate of
every group at every step must be the one a plain torch run of the same optimizer and scheduler gives.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof
from dspatch.patches.accelerate.deepspeed_scheduler_param_groups import ZIP


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
    from dspatch.scenario import reset_accelerate
    from accelerate.utils import DeepSpeedPlugin

    reset_accelerate()
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
        reset_accelerate()
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


PROOF = Proof(
    scenarios={"empty_middle_group_lambda": empty_middle_group_lambda,
               "empty_middle_group_sequential": empty_middle_group_sequential},
    expected_on_stock={"empty_middle_group_lambda": f"scheduler.step() 0: ValueError: {ZIP}",
                       "empty_middle_group_sequential": f"ValueError: {ZIP}"},
    # The releases of accelerate that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.34.0", "1.15.0"),
)
