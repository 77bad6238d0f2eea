"""Re-align a torch LR scheduler with its optimizer after DeepSpeed removed empty param groups from it.

`deepspeed.initialize` drops every param group without parameters from the client optimizer *in place*
(`basic_optimizer.param_groups[:] = [pg for pg in ... if len(pg["params"]) != 0]`, every release 0.14-0.19).
A scheduler built on that optimizer before keeps one entry per *original* group in its per-group lists
(`base_lrs`, `lr_lambdas`, ...). torch >= 2.10 zips them with the groups strictly, so the first
`scheduler.step()` raises `ValueError: zip() argument 2 is longer than argument 1`; older torch truncates: when
the removed group is not the last one, every later group gets another group's learning rate.

`remember(scheduler)` before DeepSpeed runs, `realign(scheduler, remembered)` after it: the entries of the
removed groups are dropped, the others keep their order (the kept groups are the same dict objects, so which
ones went is exact, not guessed). Nothing changes when no group was removed, or when the optimizer's groups
are not a subset of the remembered ones (something else rebuilt them: left as it is).

Used by dspatch's accelerate/deepspeed-scheduler-param-groups (Accelerator.prepare with DeepSpeed and a
torch scheduler). The Trainer path (transformers/trainer-scheduler-after-deepspeed) needs no re-alignment: as
upstream since 5.1.0 it builds the scheduler only after DeepSpeed finalised the optimizer.
"""

# per-group lists of torch's schedulers: LRScheduler (base_lrs, _last_lr), LambdaLR / MultiplicativeLR
# (lr_lambdas), CyclicLR (max_lrs, base_momentums, max_momentums), ReduceLROnPlateau (min_lrs)
PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "min_lrs", "base_momentums", "max_momentums")


def remember(scheduler):
    """The optimizer's param groups (the dict objects) as the scheduler was built on them, or None."""
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
    return list(groups) if isinstance(groups, list) else None


def kept_positions(before, now):
    """Positions in `before` of the groups in `now`, when `now` is `before` less some groups; else None."""
    position = {id(group): i for i, group in enumerate(before)}
    kept = [position.get(id(group)) for group in now]
    if None in kept or kept != sorted(set(kept)):
        return None
    return kept


def realign(scheduler, before):
    """Drop the scheduler's entries of the groups that left its optimizer since `remember`. Returns the
    positions kept, or None when there was nothing to do."""
    if before is None:
        return None
    now = scheduler.optimizer.param_groups
    if len(now) == len(before):
        return None
    kept = kept_positions(before, now)
    if kept is None:
        return None
    _drop(scheduler, kept, len(before))
    return kept


def _drop(scheduler, kept, count):
    state = vars(scheduler)
    for name in PER_GROUP:
        value = state.get(name)
        if isinstance(value, list) and len(value) == count:
            state[name] = [value[i] for i in kept]
    for inner in state.get("_schedulers", ()):  # SequentialLR, ChainedScheduler: same optimizer
        _drop(inner, kept, count)
