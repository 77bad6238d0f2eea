"""ZeRO-1/2 with the optimizer offloaded to the CPU: several `engine.backward()` calls before one `engine.step()` sum
their gradients, as without offload (deepspeed 0.14.4-0.19.8, open).

At gradient accumulation 1 every backward is a gradient-accumulation boundary, and at a boundary the offload path copies
each parameter's gradient into the fp32 partition the CPU optimizer steps (`single_partition_of_fp32_groups[i].grad`):
a copy, not an addition. A loop that calls `engine.backward` twice before one step (open-instruct's, and DeepSpeed
issue 7352's) so trains on its last micro-batch only, silently, at ZeRO-1 and ZeRO-2, on every release this project
runs (0.14.4 to 0.19.8), but for 0.19.8's bf16/fp16 runs with fp32 gradient accumulation (a partition kept until
the step, which sums). From 0.19.0 (PR 7981) the second backward also adds the CPU accumulation buffer, which the
first backward of a step does not write: it holds the previous step's last gradient, added to this one.

The workaround upstream documents, `set_gradient_accumulation_boundary(False)` before all but the last backward, does
not help at ZeRO-2 up to 0.18.9: with accumulation 1 the offload path never saves a non-boundary gradient
(`copy_grads_in_partition` saves to the CPU buffer only when `gradient_accumulation_steps > 1`), so again only the last
backward trains. 0.19.0 saves it (PR 7981); ZeRO-1 reduces only at the boundary and is right there on every release.

The fix, two parts. (1) A boundary copy for a parameter that an earlier boundary copied since the last `step()` adds the
earlier gradient back (and the norm that clipping reads is the sum's), after waiting for the device's copies; the CPU
buffer, whose content that earlier gradient already holds, is emptied first. A group on 0.19.8's compact path is left to
stock, which sums there. Not covered: a non-boundary backward between two boundaries of one step (a boundary, then
`set_gradient_accumulation_boundary(False)`, then a boundary) loses the middle one on 0.19.x. (2) On 0.14.4-0.18.9 the
offload path saves a non-boundary gradient to the CPU buffer at accumulation 1 too, and adds it back at the boundary, as
0.19.0 does (PR 7981's condition, limited to parameters whose buffer exists so that a run that never needs one allocates
none). A step with one backward, and accumulation the engine drives, meet neither: the stock code runs, bit for bit.

Proof: two `engine.backward()` a step at ZeRO-1 and ZeRO-2 with the optimizer offloaded, with and without the
boundary call: stock's gradient is the last micro-batch's (or holds the previous step's), patched it is the sum, as
plain torch's (dspatch.canary's reference), on old, mid, bridge, latest and the 0.18/0.19 sessions; in bf16 with fp32
gradient accumulation too (0.19.8's compact path: stock's sum kept).
"""
from dspatch.spec import Patch, Target

STAGE12 = "deepspeed.runtime.zero.stage_1_and_2"
COPY = "DeepSpeedZeroOptimizer.copy_grads_in_partition"
STEP = "DeepSpeedZeroOptimizer.step"
SAVES_ONLY_WHEN_GA = "self.gradient_accumulation_steps > 1"
SAVES_OUTSIDE_A_BOUNDARY = ("self.gradient_accumulation_steps > 1 or not self.is_gradient_accumulation_boundary or "
                            "self.micro_step_id > 0 and self.get_param_id(param) in self.accumulated_grads_in_cpu")


def _fp32_gradient(optimizer, param_id):
    """The slice of the fp32 partition's gradient that the CPU optimizer steps for this parameter."""
    group, _, offset, count = optimizer.grad_position[param_id]
    return optimizer.single_partition_of_fp32_groups[group].grad.view(-1).narrow(0, offset, count)


def _sums_itself(optimizer, param, args, kwargs):
    """Whether this parameter's group takes 0.19.8's compact path (bf16/fp16 with fp32 gradient accumulation): its fp32
    gradient partition is kept across backwards until the step, so a boundary copies the sum already."""
    compact = getattr(optimizer, "_use_compact_grad_partition_buffer", None)
    if compact is None:
        return False
    group = args[1] if len(args) > 1 else kwargs.get("group_idx")
    return bool(compact(optimizer._get_param_group_idx(param) if group is None else group))


def adding_to_earlier_boundaries(copied):
    """copy_grads_in_partition's wrapper; `copied` {optimizer: {id of a parameter}}, weakly keyed: the parameters a
    boundary copied into the fp32 partition since the last step."""
    import weakref

    last = [lambda: None, set()]  # the optimizer last seen (weakly) and its set: one lookup a step, not a parameter

    def copy(wrapped, optimizer, args, kwargs):
        if not optimizer.cpu_offload:
            return wrapped(*args, **kwargs)
        flag = optimizer.is_gradient_accumulation_boundary  # an attribute until 0.19.4, a method from 0.19.5
        if not (flag() if callable(flag) else flag):
            return wrapped(*args, **kwargs)
        if last[0]() is not optimizer:
            last[:] = weakref.ref(optimizer), copied.setdefault(optimizer, set())
        done, param = last[1], args[0] if args else kwargs["param"]
        if id(param) not in done or _sums_itself(optimizer, param, args, kwargs):  # the step's first boundary: stock
            done.add(id(param))
            return wrapped(*args, **kwargs)
        param_id = optimizer.get_param_id(param)
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()  # the copies to the pinned CPU partition are asynchronous on a device
        earlier = _fp32_gradient(optimizer, param_id).clone()
        buffered = getattr(optimizer, "accumulated_grads_in_cpu", {}).get(param_id)
        if buffered is not None:  # `earlier` holds what it holds; 0.19 would add it (or an older step's) again
            buffered.zero_()
        result = wrapped(*args, **kwargs)
        get_accelerator().synchronize()
        now = _fp32_gradient(optimizer, param_id).add_(earlier)
        norm = optimizer.norm_for_param_grads.get(param_id)
        if norm is not None:  # clipping reads the norm of what the step takes
            optimizer.norm_for_param_grads[param_id] = now.to(norm.dtype).norm(2)
        return result

    return copy


def consumed(copied):
    """step's wrapper: a step takes what the boundaries copied."""
    def step(wrapped, optimizer, args, kwargs):
        done = copied.get(optimizer)
        if done:
            done.clear()  # the same set: the copy wrapper keeps it at hand
        return wrapped(*args, **kwargs)

    return step


def save_outside_a_boundary(definition):
    """Transform (0.14.4-0.18.9): the offload path's `if self.gradient_accumulation_steps > 1:` before the CPU buffer
    also saves a non-boundary gradient at accumulation 1, and adds it back at the boundary that follows."""
    import ast

    from dspatch.rewrite import expression, find_one

    test = find_one(definition, lambda node: isinstance(node, ast.If) and ast.unparse(node.test) == SAVES_ONLY_WHEN_GA,
                    "the offload path's test before its CPU buffer")
    test.test = expression(SAVES_OUTSIDE_A_BOUNDARY, test)


def apply(txn):
    import weakref

    copied = weakref.WeakKeyDictionary()
    target = txn.target(COPY)
    if target.releases == OLD:
        txn.recode(target, save_outside_a_boundary)
    txn.wrap(target, adding_to_earlier_boundaries(copied))
    txn.wrap(txn.target(STEP), consumed(copied))


OLD, NEW = "<0.19.0", ">=0.19.0"
# every release 0.14.4-0.19.8 (python tests/upstream_releases.py deepspeed/zero12-offload-backward-twice 0.14.4 0.19.8)
TARGETS = (Target(STAGE12, COPY, {"4a35f6dfe542a885": "0.14.4-0.17.0", "693369d19f3b1289": "0.17.1-0.18.9"},
                  releases=OLD),
           Target(STAGE12, COPY, {"741b192aba8b7399": "0.19.0-0.19.4", "6cbe4a5217cec229": "0.19.5-0.19.7",
                                  "ba2503ffe8082ab0": "0.19.8"}, releases=NEW),
           Target(STAGE12, STEP, {"73b8a930164eefd0": "0.14.4-0.15.1", "b5d4a3abb956a9d7": "0.15.2-0.16.9",
                                  "e911504ff646462e": "0.17.0", "571656f8dfef506c": "0.17.1-0.17.4",
                                  "1fbf6cb91744abfa": "0.17.5", "954a5cf1afdb4131": "0.17.6-0.19.1",
                                  "dcaf67d49ef8054c": "0.19.2-0.19.4", "09a319620240bafc": "0.19.5-0.19.6",
                                  "510bf7ba93679de3": "0.19.7", "d8caf0bd76d2fb43": "0.19.8"}))

PATCH = Patch(
    id="deepspeed/zero12-offload-backward-twice",
    summary=("ZeRO-1/2 with the optimizer offloaded: several engine.backward() calls before one engine.step() sum "
             "their gradients, with or without set_gradient_accumulation_boundary, as without offload"),
    cause=("With the optimizer offloaded, each boundary backward copies its gradient over the fp32 partition the CPU "
           "optimizer steps, and at accumulation 1 ZeRO-2 never keeps a non-boundary one"),
    canary=("last_only",),
    symptom="several backwards per step with offload_optimizer: only the last one's gradient silently trains",
    distribution="deepspeed",
    affected=">=0.14.4",
    fixed_in=None,
    supported=">=0.14.4",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/7352", "https://github.com/allenai/open-instruct/pull/1498",
           "https://github.com/deepspeedai/DeepSpeed/pull/7981"),
    diffs=tuple(f"deepspeed/0028-zero12-offload-backward-twice-{band}.patch" for band in (
        "0.14.4-0.15.1", "0.15.2-0.17.0", "0.17.1-0.17.4", "0.17.5-0.18.9", "0.19.0-0.19.4", "0.19.5", "0.19.6-0.19.7",
        "0.19.8")),
    note=("wraps DeepSpeedZeroOptimizer.copy_grads_in_partition (on 0.14.4-0.18.9 rebuilt from the installed source "
          "to save a non-boundary gradient at accumulation 1) and DeepSpeedZeroOptimizer.step; without offload "
          "deepspeed/zero12-backward-twice"),
)
