"""DeepSpeed's WarmupLR and WarmupCosineLR give each param group its own learning rate (deepspeed < 0.19.4).

Stock gives a group another group's rate, or a rate its schedule never reaches, and says nothing.

A silent one. DeepSpeed builds these schedulers from the `scheduler` block of its config (custom loops,
accelerate with that block, DeepSpeed-Chat) or a user builds them in code; a model whose param groups have different
learning rates (a smaller rate for the embeddings or a pretrained backbone, a larger one for a new head or LoRA
adapters) meets three bugs of `deepspeed/runtime/lr_schedules.py`:
- **WarmupLR without `warmup_max_lr`**, 0.17.2-0.19.3: every group warms up to group 0's rate (PR 8171, fixed
  0.19.4). Before 0.17.2 the default is 0.001 whatever the optimizer's rates (PR 7360, fixed 0.17.2): the same
  config trained at another rate. WarmupDecayLR keeps its own default 0.001 on every release and is left so.
- **WarmupCosineLR's first step**, 0.15.3-0.18.9: when the scheduler is built it sets the rate of group 0 only
  (its "not started" rate is a one-element list), so every other group takes its first step at its full rate
  instead of the schedule's 0 (PR 7969, fixed 0.19.0). Before 0.15.3 it sets no rate when it is built, for any group alike.

The fix is upstream's, in arguments and results only: an unset `warmup_max_lr` becomes each group's own rate (0.19.4;
the user's own value, a number or a list, is kept as it is), and WarmupCosineLR's "not started" rate has one entry
per group (0.19.0). A single group, a set `warmup_max_lr` and every other scheduler run stock's code.

Proven by numbers on the old, bridge and mid stacks and ds0183 (0.14.4, 0.16.9, 0.16.3, 0.18.3) and on the released
sources of 0.18.9 and 0.19.3: a real engine with two param groups (rates 0.1 and 0.02) and the scheduler from its
config, five SGD steps: each group's rate at each step, and the weights, equal plain torch's SGD run at the rates the
schedule's definition gives each group (computed in the reproducer, without DeepSpeed), to the bit. Stock gives
group 1 group 0's peak (0.17.2-0.19.3) or 0.001 for both (earlier), and WarmupCosineLR's group 1 its full rate at the
first step.
"""
from dspatch.spec import Patch, Target

SCHEDULES = "deepspeed.runtime.lr_schedules"
WARMUP_INIT = "WarmupLR.__init__"
COSINE_GET_LR = "WarmupCosineLR.get_lr"
TARGETS = (
    Target(SCHEDULES, WARMUP_INIT, {"5f8c263d4006e863": "0.14.0-0.15.2", "dab7d678c70a628e": "0.15.3-0.17.1",
                                    "ef195b240c63c96e": "0.17.2-0.19.2", "ff662bcde4c3a8b0": "0.19.3"}),
    # before 0.15.3 it is not called when the scheduler is built; 0.19.0 returns one rate per group
    Target(SCHEDULES, COSINE_GET_LR, {"1540edfbd444f80a": "0.15.3-0.18.9"}, releases=">=0.15.3,<0.19.0"),
)


def apply(txn):
    from deepspeed.runtime import lr_schedules

    def own_max_lrs(wrapped, scheduler, args, kwargs):
        # WarmupLR(optimizer, warmup_min_lr, warmup_max_lr, ...): unset (or None) means each group's own rate
        if len(args) < 3 and kwargs.get("warmup_max_lr") is None:
            optimizer = args[0] if args else kwargs["optimizer"]
            groups = lr_schedules.get_torch_optimizer(optimizer).param_groups
            kwargs = {**kwargs, "warmup_max_lr": [group["lr"] for group in groups]}
        return wrapped(*args, **kwargs)

    def one_rate_per_group(wrapped, scheduler, args, kwargs):
        rates = wrapped(*args, **kwargs)
        if scheduler.last_batch_iteration < 0:  # not started: 0.0 for every group, not for group 0 alone
            return [0.0 for _ in scheduler.org_lrs]
        return rates

    txn.wrap(txn.target(WARMUP_INIT), own_max_lrs)
    if txn.has(COSINE_GET_LR):  # 0.15.3-0.18.9
        txn.wrap(txn.target(COSINE_GET_LR), one_rate_per_group)


PATCH = Patch(
    id="deepspeed/lr-schedules-multigroup",
    summary=("DeepSpeed's WarmupLR (without warmup_max_lr) and WarmupCosineLR give each param group its own "
             "learning rate (silent)"),
    cause="WarmupLR and WarmupCosineLR compute one learning rate and give it to every param group",
    canary=('lr_groups', 'lr'),
    symptom="WarmupLR/WarmupCosineLR: param groups with different rates silently get wrong ones",
    distribution="deepspeed",
    affected="<0.19.4",
    fixed_in="0.19.4",
    supported=">=0.14.0",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8171", "https://github.com/deepspeedai/DeepSpeed/pull/7969",
           "https://github.com/deepspeedai/DeepSpeed/pull/7360"),
    diffs=("deepspeed/0020-lr-schedules-multigroup-0.14.0-0.15.2.patch",
           "deepspeed/0020-lr-schedules-multigroup-0.15.3-0.17.1.patch",
           "deepspeed/0020-lr-schedules-multigroup-0.17.2-0.18.9.patch",
           "deepspeed/0020-lr-schedules-multigroup-0.19.0-0.19.3.patch"),
    note=("wraps WarmupLR.__init__ (an unset warmup_max_lr is each group's rate) and, on 0.15.3-0.18.9, "
          "WarmupCosineLR.get_lr (one 'not started' rate per group)"),
)
