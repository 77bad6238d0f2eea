"""Learning rates by the schedules' definitions, per param group per optimizer step, computed without DeepSpeed: what
a config's `scheduler` block means (DeepSpeed's documentation of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle), or
the Trainer's own schedule where the config has none. OneCycle also cycles the momentum: Adam's betas per step.

DeepSpeed steps its scheduler after each optimizer step: step s runs at scheduler iteration s - 1, the first at the
schedule's "not started" rate (releases before 0.15.3 set none when the scheduler is built: the optimizer's rate).
"""
import math


def _gamma(k, warmup, kind):
    """WarmupLR's warm-up fraction at iteration k (k < warmup)."""
    if kind == "linear":
        return k / warmup
    return math.log(k + 1) / math.log(warmup)


def _per_group(value, lrs, default):
    if value is None:
        value = default
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value] * len(lrs)


def deepspeed_rates(block, lrs, steps, sets_first=True):
    """[[rate per group] per step] of a DeepSpeed `scheduler` block over `steps` optimizer steps, the groups at
    `lrs` (their own rates)."""
    kind, params = block["type"], dict(block.get("params") or {})
    warmup = max(2, int(params.get("warmup_num_steps", 1000)))
    ramp = params.get("warmup_type", "log")
    total = params.get("total_num_steps")
    if kind in ("WarmupLR", "WarmupDecayLR"):
        low = _per_group(params.get("warmup_min_lr"), lrs, 0.0)
        # WarmupLR: each group's own rate when unset (as 0.19.4 and later define it); WarmupDecayLR: 0.001
        high = _per_group(params.get("warmup_max_lr"), lrs, list(lrs) if kind == "WarmupLR" else 0.001)

        def rate(group, k):
            if k < 0:
                return low[group]
            if k < warmup:
                gamma = _gamma(k, warmup, ramp)
            elif kind == "WarmupDecayLR":
                gamma = max(0.0, (total - k) / max(1.0, total - warmup))
            else:
                gamma = 1.0
            return low[group] + (high[group] - low[group]) * gamma
    elif kind == "WarmupCosineLR":
        start, floor = params.get("warmup_min_ratio", 0.0), params.get("cos_min_ratio", 0.0001)

        def rate(group, k):
            if k < 0:
                return 0.0
            if k < warmup:
                return lrs[group] * (start + _gamma(k, warmup, ramp) * (1.0 - start))
            progress = min(1.0, (k - warmup + 1) / max(1, total - warmup))
            return lrs[group] * max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    elif kind == "OneCycle":
        rate, _ = _one_cycle(params, len(lrs))
        sets_first = True  # OneCycle sets its first rate (and momentum) when it is built, in every release
    else:
        raise ValueError(f"the scheduler {kind!r} is not modelled")
    table = [[rate(g, s - 1) for g in range(len(lrs))] for s in range(steps)]
    if not sets_first and table:
        table[0] = list(lrs)
    return table


def _one_cycle(params, groups):
    """(rate(group, k), betas(group, k)) of DeepSpeed's OneCycle at scheduler iteration k (-1: as built), from its
    documented parameters: the rate climbs from cycle_min_lr to cycle_max_lr over cycle_first_step_size iterations
    and comes back over cycle_second_step_size (in stair_count flat stairs where one is given), then decays by
    decay_lr_rate every decay_step_size; the momentum (Adam's first beta, its second 0.99) goes the other way between
    cycle_max_mom and cycle_min_mom. As built, the rate is cycle_min_lr and the momentum cycle_min_mom."""
    first = float(params.get("cycle_first_step_size", 2000))
    second = params.get("cycle_second_step_size")
    second = first if second is None else float(second)
    total, ratio = first + second, first / (first + second)
    up_stairs = int(params.get("cycle_first_stair_count", 0) or 0)
    down_stairs = params.get("cycle_second_stair_count")  # None (or absent): as many as going up
    stairs = (up_stairs, up_stairs if down_stairs is None else int(down_stairs))
    low, high = (_per_group(params.get(key), [0.0] * groups, None) for key in ("cycle_min_lr", "cycle_max_lr"))
    mom_low, mom_high = (_per_group(params.get(key), [0.0] * groups, default)
                         for key, default in (("cycle_min_mom", 0.8), ("cycle_max_mom", 0.9)))
    decay_every = float(params.get("decay_step_size", 0) or 0)
    lr_decay, mom_decay = float(params.get("decay_lr_rate", 0.0)), float(params.get("decay_mom_rate", 0.0))

    def scale(k):
        at = k + 1
        x = 1.0 + at / total - math.floor(1 + at / total)
        up = x <= ratio
        count = stairs[0] if up else stairs[1]
        if count > 0:  # flat stairs, counted from the whole iteration within the cycle
            within = at % total
            position = within * count / first if within <= first else (total - within) * count / second
            return math.floor(position) / count
        return x / ratio if up else (x - 1) / (ratio - 1)

    def decay_factor(k, rate):
        if decay_every == 0 or rate == 0:
            return 1.0
        return 1 + rate * (k - total + 1) / decay_every

    def rate(group, k):
        if k < 0:
            return low[group]
        if k < total:
            return low[group] + (high[group] - low[group]) * scale(k)
        return low[group] / decay_factor(k, lr_decay)

    def betas(group, k):
        if k < 0:
            return (mom_low[group], 0.99)
        if k < total:
            return (mom_high[group] - (mom_high[group] - mom_low[group]) * scale(k), 0.99)
        return (mom_high[group] * decay_factor(k, mom_decay), 0.99)

    return rate, betas


def deepspeed_betas(block, groups, steps):
    """[[Adam's betas per group] per step] where the `scheduler` block cycles the momentum (OneCycle with
    cycle_momentum, the default), else None."""
    params = dict(block.get("params") or {})
    if block.get("type") != "OneCycle" or not params.get("cycle_momentum", True):
        return None
    _, betas = _one_cycle(params, groups)
    return [[betas(g, s - 1) for g in range(groups)] for s in range(steps)]


def trainer_rates(name, lrs, warmup, total, steps):
    """The Trainer's own schedule (lr_scheduler_type `name`) without DeepSpeed's: rates per step per group, from
    transformers' definition of it (get_scheduler) over an optimizer that only holds the rates."""
    import torch
    from transformers import get_scheduler

    holder = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs])
    schedule = get_scheduler(name, holder, num_warmup_steps=warmup, num_training_steps=total)
    table = []
    for _ in range(steps):
        table.append([g["lr"] for g in holder.param_groups])
        holder.step()
        schedule.step()
    return table
