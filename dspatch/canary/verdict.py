"""Comparing a DeepSpeed run with its plain-torch reference, step by step, and telling the shape of the first divergence:
the rates of each param group, the gradient DeepSpeed applies, the norm it reports, the weights after.

Tolerances (relative): fp32 1e-5, as the issue fixes it; bf16 derived in BF16 below.
"""

FP32 = 1e-5
# Every shape of divergence the comparison tells, one line each: the codes a patch's `canary` names (spec.Patch).
SHAPES = {
    "divided_twice": "the gradient divided by GA once too often (or twice: two bugs at once)",
    "torch_backward_divided": "loss.backward() on the engine's output: the gradient divided by GA once too often",
    "not_divided": "the gradient never divided by GA",
    "loss_scale": "the gradient multiplied or divided by a loss scale of 65536",
    "scaled": "the gradient another multiple of the reference",
    "last_only": "only the window's (or the step's backwards') last micro-batch",
    "middle_dropped": "the window's first and last micro-batches only",
    "piled_up": "earlier steps' gradients never cleared",
    "nan": "NaN or inf in the gradient",
    "other": "a gradient of no shape above",
    "not_averaged": ("a gradient of no shape above where ZeRO-1/2 reduce through their non-contiguous path (2+ ranks "
                     "on the CPU, contiguous_gradients false)"),
    "stage_divided": "a pipeline's earlier stages divided by GA again",
    "lr_groups": "a param group at another group's rate",
    "lr": "the rates of several groups off",
    "lr_schedule": "the schedule's own rates off",
    "update": "the weights moved otherwise than the optimizer the config means moves them",
    "adam_step_early": "Adam's first step taken as its second",
    "clipping": "the clipping asked for not applied",
    "stage_clipping": "a pipeline clipped by another norm",
    "clip_call": "the max_norm the loop's accelerator.clip_grad_norm_ asked for not applied",
    "grad_norm": "the reported gradient norm off",
    "windows": "another number of optimizer steps than the loop means",
    "unsharded": "each rank trained on every rank's micro-batches",
    "skipped": "fp16: a step skipped that the loss scaler does not mean, or the reverse",
    "loss_scale_schedule": "fp16: a loss scale other than the config's scaler gives",
    "crash": "the run raised",
}
# bf16 keeps 8 significant bits: one rounding is a relative error of at most 2^-8 (its unit roundoff,
# torch.finfo(torch.bfloat16).eps / 2). The model's forward and backward run in bf16 on both sides from the same bf16
# weights, and a window's gradient meets roundings plain torch's need not share: in each micro-batch's own gradient
# (ZeRO-3 computes a linear layer's gradients with its own matmuls, LinearFunctionForZeroStage3: another summation
# order before the bf16 rounding) and in the window's sum (kept in bf16 on some paths, fp32 on others). The margin
# counts two roundings a micro-batch, max(4, 2 * N) * 2^-8 for N = GA x backwards micro-batches a step: a count, not a
# bound (errors carried through the backward, or a sum that cancels, can exceed it), checked against measurement:
# worst 0.86% on latest (ZeRO-3, 2 backwards a step) against 1.6%. The bugs it tells from right are factors (1/GA, GA,
# 65536) or whole micro-batches left out (>= 1/N of the gradient): beyond N = 8 the margin is capped at 1/(2N), half a
# micro-batch's share, so that one left out still shows (where bf16 noise may then come near it: said in the docs).
BF16_PER_ROUNDING = 2.0 ** -8
# fp16 keeps 11 significant bits: its unit roundoff is 2^-11, counted as bf16's (the loss scale keeps the gradients
# in fp16's normal range; a step whose scaled gradient overflows is skipped, not compared)
PER_ROUNDING = {"bf16": BF16_PER_ROUNDING, "fp16": 2.0 ** -11}


def unreduced_here(plan):
    """Whether the run reduces its gradients through ZeRO-1/2's non-contiguous path between ranks on the CPU (where
    releases before 0.19.8 all-reduce nothing): a gradient of no other shape there is told apart from any other."""
    zero = plan["config"].get("zero_optimization") or {}
    return (plan["data_ranks"] > 1 and plan.get("device", "cpu") == "cpu" and plan["stage"] in (1, 2)
            and zero.get("contiguous_gradients") is False)


def tolerance(plan):
    if plan["precision"] in PER_ROUNDING:
        count = plan["accumulation"] * plan["backwards"]
        return min(max(4, 2 * count) * PER_ROUNDING[plan["precision"]], 1 / (2 * count))
    return FP32


def _flat(named, names):
    import torch

    return torch.cat([named[n].reshape(-1).double() for n in names])


def _off(got, want):
    """Relative distance of two vectors (inf where `got` is not finite)."""
    import torch

    if not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = float(want.norm()) or 1.0
    return float((got - want).norm()) / scale


def _scale(got, want, tol):
    """The factor that makes `want` `got` (`got` is that multiple of `want` within the tolerance), or None."""
    ratio = float(got.dot(want) / want.dot(want)) if float(want.norm()) else 0.0
    return ratio if _off(got, ratio * want) <= max(tol, 1e-4) else None


def gradient_shape(got, want, parts, earlier, ga, tol):
    """What a gradient that differs from the reference's is, in words (and a code for the known bugs' matching)."""
    import torch

    if not bool(torch.isfinite(got).all()):
        return "nan", "the gradient holds NaN or inf"
    ratio = _scale(got, want, tol)
    if ratio is not None and ratio > 0:
        for factor, code, words in ((1 / ga, "divided_twice", f"1/{ga} of the reference: divided by GA twice"),
                                    (1 / ga ** 2, "divided_twice", f"1/{ga * ga} of the reference: divided by GA three "
                                     "times (two bugs at once)"),
                                    (ga, "not_divided", f"{ga}x the reference: never divided by GA"),
                                    (1 / 65536, "loss_scale", "1/65536 of the reference: divided by a loss scale"),
                                    (65536, "loss_scale", "65536x the reference: multiplied by a loss scale (bf16 "
                                     "needs none)")):
            if (ga > 1 or code == "loss_scale") and abs(ratio - factor) <= 1e-3 * factor:
                return code, words
        return "scaled", f"{ratio:.4g}x the reference"
    if len(parts) > 1:
        last = parts[-1]
        alone = ("only the last micro-batch of the window (divided by GA)" if ga > 1
                 else "only the last backward's micro-batch: the step's earlier backwards dropped")
        for scale, words in ((1.0, alone), (float(len(parts)), "only the last micro-batch of the window (undivided)")):
            if _off(got, scale * last) <= max(tol, 1e-4):
                return "last_only", words
        ends = parts[0] + parts[-1]
        if len(parts) > 2 and _off(got, ends) <= max(tol, 1e-4):
            return "middle_dropped", "the first and last micro-batches only: the middle ones left out"
    if earlier is not None and _off(got, want + earlier) <= max(tol, 1e-4):
        return "piled_up", "the reference plus the earlier steps' gradients: gradients never cleared after a step"
    return "other", f"{_off(got, want):.3g} of the reference's norm apart"


def stage_shape(got, want, stages, ga, tol):
    """A pipeline's gradient whose last stage is right and each earlier stage 1/GA of the reference per later stage
    (("stage_divided", words)), or None. `got`, `want`: {name: gradient}; `stages`: each stage's names."""
    if ga < 2 or len(stages) < 2:
        return None
    found = []
    for names in stages:
        ratio = _scale(_flat(got, names), _flat(want, names), tol)
        if ratio is None:
            return None
        found.append(ratio)
    for later, ratio in enumerate(reversed(found)):
        if abs(ratio - ga ** -later) > max(1e-3, tol) * ga ** -later:
            return None
    earlier = f"1/{ga} of the reference on the stage before it" + \
        (f", 1/{ga}^k k stages before it" if len(stages) > 2 else "")
    return "stage_divided", f"right on the last pipeline stage, {earlier}: divided by GA again for each later stage"


def _rates_shape(got, want):
    if len(want) > 1 and all(abs(g - got[0]) <= 1e-12 + 1e-9 * abs(got[0]) for g in got) and got[0] != want[1]:
        return "lr_groups", "every param group at group 0's rate"
    if all(abs(g - 0.001) <= 1e-12 for g in got):
        return "lr_groups", "every param group at 0.001 (a default, not the optimizer's rate)"
    words = "rates " + ", ".join(f"{g:.6g}" for g in got) + " where the schedule gives " + \
        ", ".join(f"{w:.6g}" for w in want)
    # groups meant at one rate (or one group): the schedule itself is off, not a group at another's rate
    return ("lr" if len(set(want)) > 1 else "lr_schedule"), words


def _adam_second_step(plan):
    """How far an Adam-like optimizer's first update moves, relative to its first, when it is taken as the second
    (bias corrections of step 2 for moments of one gradient: sqrt(1 + beta2) / (1 + beta1)); None for other
    optimizers."""
    block = plan["config"].get("optimizer") or {"type": "AdamW", "params": {}}
    if str(block.get("type", "")).lower() not in ("adam", "adamw"):
        return None
    beta1, beta2 = (block.get("params") or {}).get("betas", (0.9, 0.999))
    return (1 + beta2) ** 0.5 / (1 + beta1)


# Upstream bugs the canary found that no patch fixes (nor dspatch/known.py lists: an option few set, or a start-up
# cost rather than wrong numbers): (shape, distribution, the releases, what it is). A divergence of that shape on
# those releases names it instead of "a new bug".
FINDINGS = (
    ("lr_schedule", "deepspeed", "<0.19.4", "OneCycle's cycle_first_stair_count/cycle_second_stair_count do nothing "
     "before deepspeed 0.19.4 (upstream PR 8179)"),
    ("loss_scale_schedule", "deepspeed", "<0.17.1", "an fp16 block that sets none of initial_scale_power, "
     "loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale starts at 2^32 with hysteresis 1 before "
     "deepspeed 0.17.1, not at the documented 2^16 with hysteresis 2: its first steps are skipped (set "
     "initial_scale_power to have the documented scaler)"),
)


def findings(code):
    """The FINDINGS of this shape on the installed releases: [words]."""
    from dspatch.upstream import installed_version
    from dspatch.versions import SpecifierSet, Version

    found = []
    for shape, distribution, releases, words in FINDINGS:
        version = installed_version(distribution)
        if shape == code and version and SpecifierSet(releases).contains(Version(version).base_version):
            found.append(words)
    return found


def power(value):
    """2^k where `value` is one, else the number."""
    import math

    exponent = math.log2(value) if value > 0 else 0.5
    return f"2^{int(exponent)}" if exponent.is_integer() else f"{value:g}"


def _scaler_shape(mine, theirs):
    """fp16's loss scale and skipped steps against the config's scaler: {"what", "code", "words"}, or None."""
    want, got = theirs.get("scale"), mine.get("scale")
    if want and want != 1 and got is not None and abs(got - want) > 1e-9 * want:
        return {"what": "loss scale", "code": "loss_scale_schedule",
                "words": f"DeepSpeed's loss scale is {power(got)} where the config's scaler gives {power(want)}"}
    if want and want != 1 and bool(mine.get("skipped")) != bool(theirs.get("skipped")):
        words = (f"DeepSpeed skipped this step for an overflow, though its gradient at loss scale {power(want)} is "
                 "finite"
                 if mine.get("skipped") else
                 f"DeepSpeed applied this step, though its gradient overflows fp16 at loss scale {power(want)}")
        return {"what": "skipped step", "code": "skipped", "words": words}
    return None


def compare(plan, got, want, start):
    """The first divergence of the DeepSpeed record `got` from the reference's replay of it `want` (from the same
    `start` weights), or None: {"step", "what", "code", "words"}."""
    tol = tolerance(plan)
    if got.get("error"):
        return {"step": len(got["steps"]) + 1, "what": "crash", "code": "crash", "words": got["error"].splitlines()[0],
                "error": got["error"]}
    if len(got["steps"]) != want["count"]:
        from dspatch.canary.plan import steps_taken

        ranks = plan["data_ranks"]
        if ranks > 1 and len(got["steps"]) == steps_taken(plan["loop"], plan["per_epoch"] * ranks, plan["accumulation"],
                                                          plan["epochs"], plan.get("accumulate", True)):
            return {"step": min(len(got["steps"]), want["count"]) + 1, "what": "steps", "code": "unsharded",
                    "words": f"DeepSpeed took {len(got['steps'])} optimizer steps where the loop means "
                             f"{want['count']}: as many as one rank takes over every rank's micro-batches (the data "
                             f"not sharded between the ranks)"}
        return {"step": min(len(got["steps"]), want["count"]) + 1, "what": "steps", "code": "windows",
                "words": f"DeepSpeed took {len(got['steps'])} optimizer steps where the loop means {want['count']}: "
                         f"its accumulation windows are not the loop's (epochs of {plan['per_epoch']} micro-batches "
                         f"at accumulation {plan['accumulation']})"}
    names = sorted(start)
    limit = plan.get("steps") or len(want["steps"])
    before, earlier = _flat(start, names), None
    for number, (mine, theirs) in enumerate(zip(got["steps"][:limit], want["steps"][:limit]), 1):
        rates, expected = [float(r) for r in mine["lrs"]], [float(r) for r in theirs["lrs"]]
        if len(expected) == 1 and len(rates) > 1:  # the Trainer's own groups (decay and not), all at the one rate
            expected = expected * len(rates)
        if len(rates) != len(expected) or any(abs(a - b) > 1e-12 + 1e-6 * abs(b) for a, b in zip(rates, expected)):
            code, words = _rates_shape(rates, expected)
            return {"step": number, "what": "learning rate", "code": code, "words": words}
        scaled = _scaler_shape(mine, theirs)
        if scaled:
            return {"step": number, **scaled}
        if theirs.get("skipped"):  # skipped, as the config's scaler means: nothing applied, nothing moved
            after = _flat(mine["weights"], names)
            if float((after - before).norm()):
                return {"step": number, "what": "update", "code": "update",
                        "words": "the weights moved on a step skipped for an overflow (the loss scale's)"}
            before = after
            continue
        given = {n: (mine["gradient"].get(n) if mine["gradient"].get(n) is not None else theirs["gradient"][n] * 0)
                 for n in names}
        applied, wanted = _flat(given, names), _flat(theirs["gradient"], names)
        if _off(applied, wanted) > tol:
            parts = [_flat(part, names) for part in theirs["parts"]]
            code, words = stage_shape(given, theirs["gradient"], got.get("stages") or [], plan["accumulation"], tol) or \
                gradient_shape(applied, wanted, parts, earlier, plan["accumulation"], tol)
            if code == "divided_twice" and plan.get("backward") == "torch":  # the loop's own backward: a shape of its own
                code = "torch_backward_divided"
            elif code == "other" and unreduced_here(plan):
                code = "not_averaged"
            return {"step": number, "what": "gradient", "code": code, "words": f"the gradient is {words}"}
        after, predicted = _flat(mine["weights"], names), _flat(theirs["weights"], names)
        moved = after - before
        if _off(moved, predicted - before) > tol:
            ratio = float(moved.norm()) / (float((predicted - before).norm()) or 1.0)
            words = f"the weights moved {ratio:.4g}x as far as the optimizer the config means moves them"
            code = "update"
            early = _adam_second_step(plan)
            if number == 1 and early and abs(ratio - early) <= 1e-3:
                code = "adam_step_early"
                words += (" (as Adam's second step, not its first: the optimizer was stepped once before training, "
                          "its step count off by one)")
            elif theirs.get("clipped"):
                # a pipeline clips with a norm gathered across its stages: a shape of its own
                code = "stage_clipping" if len(got.get("stages") or ()) > 1 else "clipping"
                if plan.get("clip_call") is not None and number > 1:  # what the loop's own call asked for
                    code = "clip_call"
                words += (f" (it clips this step's gradient of norm {theirs['grad_norm']:.4g} to {theirs['clipped']}: "
                          f"DeepSpeed's clipping is another{' on this pipeline' if code == 'stage_clipping' else ''})")
            return {"step": number, "what": "update", "code": code, "words": words}
        reported = mine.get("grad_norm")
        actual = theirs["grad_norm"]
        if reported is not None and actual and abs(reported - actual) > max(tol, 1e-4) * actual:
            return {"step": number, "what": "reported gradient norm", "code": "grad_norm",
                    "words": f"the gradient norm DeepSpeed reports is {reported / actual:.4g}x the norm of the "
                             f"gradient it applied ({reported:.6g} against {actual:.6g})"}
        earlier = applied if earlier is None else earlier + applied
        before = after
    return None
