"""Reproducers: real deepspeed.initialize (CPU, one process, ZeRO-0, fp32) of an MLP whose two layers are two param
groups with different rates (0.1 and 0.02), a torch SGD, and DeepSpeed's scheduler built from the `scheduler` block
of the config; five steps of `engine.backward(loss); engine.step()`. A silent bug, proven by numbers.

The reference is the same schedule computed without DeepSpeed: each group's rate at each step from the schedule's
definition (DeepSpeed's documentation: WarmupLR warms each group from `warmup_min_lr` up to `warmup_max_lr`, which
is the group's own rate when unset; WarmupCosineLR scales each group's own rate by a warm-up ratio, then a cosine),
set by hand on plain torch's SGD. Each step's rates are compared (to 1e-12 of the larger rate) and so are the weights after the
five steps (relative 1e-6; they agree to the bit here). The first step takes the schedule's "not started" rate
where the release sets one when the scheduler is built (0.15.3 and later), the optimizer's rate before (there every
group alike). Where the rates differ, the reproducer says "bug" only for this bug's shape (group 0's peak or 0.001
for every group; group 1 at its full rate at the first step), and fails with an error otherwise.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

RATES, STEPS, RTOL = (0.1, 0.02), 5, 1e-6
WARMUP = {"warmup_min_lr": 0.001, "warmup_num_steps": 4, "warmup_type": "linear"}  # no warmup_max_lr
COSINE = {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.0001,
          "warmup_type": "linear"}


def _sets_rates_when_built():
    """Whether this deepspeed sets the schedule's first rate when the scheduler is built (0.15.3 and later)."""
    import deepspeed

    from dspatch.versions import Version

    return Version(Version(deepspeed.__version__).base_version) >= Version("0.15.3")


def _warmup_rate(group_peak, k):
    """WarmupLR (linear) at scheduler iteration `k` (-1: not started), warming up to `group_peak`."""
    low, steps = WARMUP["warmup_min_lr"], WARMUP["warmup_num_steps"]
    gamma = 0.0 if k < 0 else (k / steps if k < steps else 1.0)
    return low + (group_peak - low) * gamma


def _cosine_ratio(k):
    """WarmupCosineLR's ratio (linear warm-up) at scheduler iteration `k` (-1: not started, 0.0)."""
    import math

    warm, total, low = COSINE["warmup_num_steps"], COSINE["total_num_steps"], COSINE["cos_min_ratio"]
    if k < 0:
        return 0.0
    if k < warm:
        return COSINE["warmup_min_ratio"] + (k / warm) * (1.0 - COSINE["warmup_min_ratio"])
    cosine = (1 + math.cos(math.pi * (k - warm + 1) / (total - warm))) / 2
    return max(0.0, low + (1.0 - low) * cosine)


def _schedule(rate_at, first=None):
    """Each step's rate per group: step s runs at scheduler iteration s - 1 (the engine steps the scheduler after
    the optimizer); `rate_at(group, k)`; `first`, the rates of the first step where the release sets none when built."""
    rates = [[rate_at(g, s - 1) for g in range(len(RATES))] for s in range(STEPS)]
    if not _sets_rates_when_built():
        rates[0] = list(first or RATES)
    return rates


def _model(one_group=False):
    """The MLP and its param groups: each layer one, at RATES (`one_group`: both layers in one, at RATES[0])."""
    import torch

    from dspatch.scenario import tiny_mlp

    model = torch.nn.Sequential(*tiny_mlp())
    if one_group:
        return model, [{"params": list(model.parameters()), "lr": RATES[0]}]
    groups = [{"params": list(model[0].parameters()), "lr": RATES[0]},
              {"params": list(model[2].parameters()), "lr": RATES[1]}]
    return model, groups


def _pairs():
    from dspatch.patches.deepspeed.grad_accum_scale_no_allreduce.reproducers import GA
    from dspatch.scenario import regression_pairs as pairs

    return pairs(STEPS * GA)[:STEPS]  # the accumulation reproducers' first pairs


def _plain_torch(schedule):
    """The weights after STEPS plain torch SGD steps at the rates of `schedule` (a rate per group per step)."""
    import torch

    from dspatch.scenario import weights

    model, groups = _model()
    optimizer = torch.optim.SGD(groups)
    for rates, (x, y) in zip(schedule, _pairs()):
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def deepspeed_run(scheduler, one_group=False):
    """(each step's rates per group as the optimizer stepped, the weights after) with DeepSpeed's `scheduler`."""
    import torch

    from dspatch.scenario import init_deepspeed, on_accelerator, weights

    deepspeed = init_deepspeed()
    model, groups = _model(one_group)
    optimizer = torch.optim.SGD(groups)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}, "scheduler": scheduler}
    engine, _, _, built = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if type(built).__name__ != scheduler["type"]:  # the run is the one meant
        raise AssertionError(f"deepspeed built the scheduler {type(built).__name__}, not {scheduler['type']}")
    seen = []
    for x, y in _pairs():
        loss = torch.nn.functional.mse_loss(engine(on_accelerator(x)), on_accelerator(y))
        engine.backward(loss)
        seen.append([group["lr"] for group in optimizer.param_groups])  # what this step's optimizer.step uses
        engine.step()
    return seen, weights(model)


def _off(got, want):
    """The largest difference between two schedules, relative to the largest rate (a schedule's rate may be 0)."""
    if len(got) != len(want) or any(len(a) != len(b) for a, b in zip(got, want)):
        return float("inf")
    return max(abs(float(a) - b) for step_got, step_want in zip(got, want) for a, b in zip(step_got, step_want)) \
        / max(RATES)


def _judge(scheduler, want, shapes):
    """Nothing where DeepSpeed's rates and weights are those of `want`; BugSeen where its rates are those of one of
    `shapes` ({what: schedule}, this bug's) and its weights follow from them; else an error."""
    from dspatch.scenario import worst

    seen, got = deepspeed_run(scheduler)
    if _off(seen, want) <= 1e-12:
        off = worst(got, _plain_torch(want))
        if off > RTOL:
            raise AssertionError(f"{scheduler['type']}: the rates are the schedule's, the weights {off:.2e} off")
        return
    for what, schedule in shapes.items():
        if _off(seen, schedule) <= 1e-12 and worst(got, _plain_torch(schedule)) <= RTOL:
            raise BugSeen(f"{scheduler['type']} with two param groups (rates {RATES[0]} and {RATES[1]}): {what} "
                          f"(rates per step {seen}, the schedule's {want})")
    raise AssertionError(f"{scheduler['type']}: rates per step {seen}, not the schedule's {want}, nor this bug's")


def warmup_lr():
    """WarmupLR from the config without `warmup_max_lr`: each group warms up to its own rate (0.1 and 0.02)."""
    want = _schedule(lambda g, k: _warmup_rate(RATES[g], k))
    shapes = {"group 1 warmed up to group 0's rate": _schedule(lambda g, k: _warmup_rate(RATES[0], k)),
              "every group warmed up to 0.001, not its own rate": _schedule(lambda g, k: _warmup_rate(0.001, k))}
    _judge({"type": "WarmupLR", "params": WARMUP}, want, shapes)


def warmup_cosine_lr():
    """WarmupCosineLR from the config: every group takes its first step at the schedule's "not started" rate (0.0),
    then its own rate times the schedule's ratio."""
    want = _schedule(lambda g, k: RATES[g] * _cosine_ratio(k))
    stock = [list(step) for step in want]
    stock[0][1] = RATES[1]  # group 1 left at its full rate when the scheduler was built
    _judge({"type": "WarmupCosineLR", "params": COSINE}, want,
           {"group 1 took its first step at its full rate, not the schedule's 0.0": stock})


PROOF = Proof(
    scenarios={"warmup_lr": warmup_lr, "warmup_cosine_lr": warmup_cosine_lr},
    expected_on_stock={"warmup_lr": "warmed up to", "warmup_cosine_lr": "group 1 took its first step at its full rate"},
    # before 0.15.3 WarmupCosineLR sets no rate when built (every group alike); 0.19.0 fixed its first step
    stock_fails_on={"warmup_cosine_lr": ">=0.15.3,<0.19.0"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    silent="param groups' learning rates wrong, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183",),
)
