"""The plain-torch side of a canary run: no DeepSpeed, the same model, data and order, implementing what the
configuration means: the optimizer and its parameters, the learning-rate schedule, gradient clipping, the accumulation
windows of the loop (with their divisors, and a last partial window where the loop has one), the precision (fp32; bf16
as mixed precision: a bf16 model, fp32 master weights, the gradient kept in fp32).

It replays DeepSpeed's run step by step (see replay): each step's gradient and update are checked from the weights
DeepSpeed had, so a rounding difference of bf16 (or of a reordered fp32 sum) never grows across steps into a false
alarm, and the first step that is wrong is the one reported.
"""


def windows(plan):
    """[(micro-batch index, divisor)] per optimizer step, over the plan's epochs, as its loop means them:
    - the raw engine loop: DeepSpeed's own count over the whole stream, each backward's loss divided by GA, a last
      partial window never applied (each `engine.step()` call consumes `backwards` micro-batches);
    - an accelerate loop under `accumulate`: windows end with each epoch, each loss divided by GA (without
      `accumulate`, DeepSpeed's own count, as the raw engine loop);
    - the Trainer: windows end with each epoch; a causal LM's loss is its tokens' mean over the window (4.46+), a head
      with a mean loss divided by the window's length (4.55+) or GA."""
    from dspatch.canary.plan import deepspeed_counts, version_of

    ga, per_epoch, epochs, calls = plan["accumulation"], plan["per_epoch"], plan["epochs"], plan["backwards"]
    steps = []
    if deepspeed_counts(plan["loop"], plan.get("accumulate", True)):  # a pipeline's train_batch: GA micro-batches
        stream = [(epoch, index) for epoch in range(epochs) for index in range(per_epoch)]
        for start in range(0, len(stream) - ga + 1, ga):
            steps.append([(i * calls + c, ga) for _, i in stream[start:start + ga] for c in range(calls)])
        return steps[:plan.get("early") or len(steps)]  # a run stopped after the steps it compares
    transformers = version_of("transformers")
    if plan["loop"] == "trainer" and transformers < (4, 47):
        # the Trainer before 4.47 steps by its count over the whole run, as DeepSpeed does; 4.46 divides each
        # micro-batch's loss by the tokens of the group of GA (or the epoch's remainder) it was fetched in
        def divisor(index):
            if transformers < (4, 46) or plan["head"] != "causal":
                return ga
            last = per_epoch // ga * ga
            return (per_epoch - last or ga) if index >= last else ga

        stream = [index for _ in range(epochs) for index in range(per_epoch)]
        return [[(index, divisor(index)) for index in stream[start:start + ga]]
                for start in range(0, len(stream) - ga + 1, ga)]
    for _ in range(epochs):
        for start in range(0, per_epoch, ga):
            window = list(range(start, min(start + ga, per_epoch)))
            divisor = ga
            if plan["loop"] == "trainer" and (transformers >= (4, 55) or
                                              (transformers >= (4, 46) and plan["head"] == "causal")):
                divisor = len(window)
            steps.append([(i, divisor) for i in window])
    return steps


def rates(plan, count):
    """The rates per group for `count` optimizer steps."""
    from dspatch.canary.plan import version_of
    from dspatch.canary.schedules import deepspeed_rates, trainer_rates

    block = plan["config"].get("scheduler")
    if block:
        return deepspeed_rates(block, plan["lrs"], count, sets_first=version_of("deepspeed") >= (0, 15, 3))
    if plan["loop"] == "trainer":
        from dspatch.canary.plan import steps_taken

        total = steps_taken("trainer", plan["per_epoch"], plan["accumulation"], plan["epochs"])
        return trainer_rates(plan["trainer_scheduler"], plan["lrs"], plan["warmup_steps"], total, count)
    return [list(plan["lrs"]) for _ in range(count)]


def momentum(plan, count):
    """Adam's betas per group for `count` optimizer steps where the schedule cycles them (OneCycle), else None."""
    from dspatch.canary.schedules import deepspeed_betas

    block = plan["config"].get("scheduler")
    return deepspeed_betas(block, len(plan["lrs"]), count) if block else None


def clipping(plan):
    """The norm the gradient is clipped to (0: none): the config's gradient_clipping; where it sets none, for the
    Trainer max_grad_norm (as the Trainer clips without DeepSpeed), else DeepSpeed's own default (1.0 from 0.19.3,
    none before)."""
    from dspatch.canary.plan import version_of

    if plan["clip"] is not None:
        return float(plan["clip"])
    if plan["loop"] == "trainer":
        return float(plan["max_grad_norm"] or 0.0)
    return 1.0 if version_of("deepspeed") >= (0, 19, 3) else 0.0


def replay(plan, got):
    """The reference, step by step along DeepSpeed's own trajectory (so that a small difference early cannot grow into
    a large one later): at each step the model is set to the weights DeepSpeed had before it, and
    - the gradient the loop means is computed there: each micro-batch of the window in the plan's precision, its loss
      over the window's divisor, the sum kept in fp32 ("gradient"; each micro-batch's share in "parts");
    - the optimizer the config means, fed the gradient DeepSpeed applied (clipped as the config means, at the
      schedule's rates), takes its step from those weights: where DeepSpeed's weights should be after it ("weights").
    Returns {"steps": [{"lrs", "gradient", "parts", "grad_norm" (of DeepSpeed's gradient), "clipped", "weights"}]}."""
    import torch

    from dspatch.canary.model import build, groups, micro_batches, optimizer_of

    import math

    from dspatch.canary.loss_scale import Scaler, overflowed
    from dspatch.canary.plan import version_of

    model = build(plan)
    low = _low(plan)  # mixed precision: fp32 masters
    if low is not None:
        model = model.to(low)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = {n: (torch.nn.Parameter(p.detach().float().clone()) if low is not None else p) for n, p in named}
    by_tensor = {id(p): masters[n] for n, p in named}
    optimizer = optimizer_of(plan, [{**group, "params": [by_tensor[id(p)] for p in group["params"]]}
                                    for group in groups(model, plan["lrs"])])
    # the data-parallel ranks' micro-batches (a pipeline's stages share one stream)
    ranks = [micro_batches(plan, rank) for rank in range(plan["data_ranks"])]
    plan_windows = windows(plan)
    table = rates(plan, len(plan_windows))
    moments = momentum(plan, len(plan_windows)) if "betas" in optimizer.defaults else None
    clip = clipping(plan)
    scaler = Scaler(plan["config"].get("fp16"), stable_interval=version_of("deepspeed") >= (0, 17, 1)) \
        if plan["precision"] == "fp16" else None
    before = start(plan)
    steps, taken = [], 0  # taken: the steps applied (a skipped one advances neither the schedule nor the optimizer)
    for window, theirs in zip(plan_windows, got["steps"]):
        step_rates = table[min(taken, len(table) - 1)]
        if plan.get("clip_call") is not None and steps:
            # the loop's accelerator.clip_grad_norm_(params, NORM): DeepSpeed steps inside accelerator.backward,
            # before the call, so the first step clips as configured, and NORM is what the loop asks for after it
            clip = float(plan["clip_call"])
        with torch.no_grad():  # DeepSpeed's weights before this step, on both copies
            for n, p in named:
                masters[n].copy_(before[n])
                if low is not None:
                    p.copy_(before[n])
        scale = scaler.scale if scaler else 1.0
        sums = {n: torch.zeros_like(before[n]) for n, _ in named}
        parts, peak = [], 0.0  # each micro-batch's share of the gradient; the largest scaled fp16 value
        for index, divisor in window:
            part = {n: torch.zeros_like(sums[n]) for n, _ in named}
            for batches in ranks:  # data parallel: each rank's micro-batch, the gradient averaged over the ranks
                (model(**batches[index]).loss / (divisor * len(ranks)) * scale).backward()
                for n, p in named:  # kept in fp32, as DeepSpeed's ZeRO optimizers and mixed-precision masters keep it
                    if p.grad is not None:
                        if scaler:
                            top = float(p.grad.abs().max())
                            peak = max(peak, top if math.isfinite(top) else float("inf"))
                        part[n] += p.grad.float() / scale
                    p.grad = None
            for n, _ in named:
                sums[n] += part[n]
            parts.append(part)
        skipped = False
        if scaler and scaler.dynamic:  # a clear overflow skips; one too close to call is DeepSpeed's to decide
            skipped = overflowed(peak, len(window) * len(ranks))
            skipped = bool(theirs.get("skipped")) if skipped is None else skipped
            scaler.update(skipped)
        applied = {n: (theirs["gradient"].get(n) if theirs["gradient"].get(n) is not None else torch.zeros_like(sums[n]))
                   for n, _ in named}
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in applied.values())))
        if not skipped:
            for n, _ in named:
                masters[n].grad = applied[n].clone()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([masters[n] for n, _ in named], clip)
            for group, rate in zip(optimizer.param_groups, step_rates):
                group["lr"] = rate
            for group, betas in zip(optimizer.param_groups, moments[taken] if moments else ()):
                group["betas"] = betas
            optimizer.step()
            optimizer.zero_grad()
            taken += 1
        steps.append({"lrs": step_rates, "gradient": sums, "parts": parts, "grad_norm": norm,
                      "clipped": clip if 0 < clip < norm and not skipped else None, "scale": scale,
                      "skipped": skipped, "weights": {n: masters[n].detach().float().clone() for n, _ in named}})
        before = {n: theirs["weights"][n].float() for n in before}
    return {"steps": steps, "count": len(plan_windows)}


def _low(plan):
    """The 16-bit dtype the plan's model computes in (bf16, fp16), or None for fp32."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan["precision"])


def start(plan):
    """The fp32 weights both sides start from (bf16, fp16: rounded to it first, as DeepSpeed's masters are made)."""
    from dspatch.canary.model import build

    model = build(plan)
    low = _low(plan)
    if low is not None:
        model = model.to(low)
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
