"""Learning rates by the schedules' definitions, per param group per optimizer step, computed without DeepSpeed: what
a config's `scheduler` block means (DeepSpeed's documentation of WarmupLR, WarmupDecayLR, WarmupCosineLR), or the
Trainer's own schedule where the config has none.

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
    else:
        raise ValueError(f"the scheduler {kind!r} is not modelled")
    table = [[rate(g, s - 1) for g in range(len(lrs))] for s in range(steps)]
    if not sets_first and table:
        table[0] = list(lrs)
    return table


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
