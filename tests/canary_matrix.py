"""The quiet matrix of `dspatch canary` (issue 50): configurations where nothing is wrong, with every patch on, must
train as plain torch does. Shared by tests/test_canary_quiet*.py (two files: pytest-xdist hands a file to one worker)."""
import itertools
import os

from conftest import STACK, clean_env

# every combination on latest; a sample elsewhere (the releases there are proven patch by patch)
FULL = ("latest",)


def configurations(loop):
    """[(label, plan)] of the matrix: ZeRO 0-3 x GA 1/3 x fp32/bf16 x CPU offload (ZeRO 1-3) x clipping, for one loop
    (a sample of it off the latest stack); the engine loop also with two backwards a step in bf16."""
    from dspatch.canary.plan import build_plan, default_options

    found = []
    for stage, ga, precision, offload, clip in itertools.product((0, 1, 2, 3), (1, 3), ("fp32", "bf16"),
                                                                   (False, True), (False, True)):
        if offload and stage == 0:
            continue
        if STACK not in FULL and not (ga == 3 and clip and not offload and stage in (0, 2)):
            continue
        config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if loop != "trainer":
            config["gradient_clipping"] = 0.5 if clip else 0.0
        options = default_options(loop=loop, accumulation=ga, precision=precision, max_grad_norm=0.5 if clip else 0.0)
        found.append((f"ZeRO-{stage} GA {ga} {precision}{' offload' if offload else ''}"
                      f"{' clip' if clip else ''}", build_plan(config, options)))
    if loop == "engine" and STACK in FULL:  # two backwards a step in bf16: the tolerance's worst case measured
        found += [(f"ZeRO-{stage} bf16, 2 backwards a step", build_plan(
            {"zero_optimization": {"stage": stage}}, default_options(precision="bf16", backwards=2)))
            for stage in (0, 1, 2, 3)]
    if STACK in FULL:  # the loops of catalogue 6 (issue 58), each where its bug was, with nothing wrong
        found += _catalogue_6_loops(loop)
    return found


def _catalogue_6_loops(loop):
    """The engine loop's loss.backward() (ZeRO-1-3 x fp32/bf16 at GA 3, and fp16 on the scaled loss); the accelerate
    loop without accumulate() (ZeRO 0-3 at GA 3) and calling clip_grad_norm_ at a norm other than the config's."""
    from dspatch.canary.plan import build_plan, default_options

    if loop == "engine":
        plans = [(f"ZeRO-{stage} GA 3 {precision}, loss.backward()", build_plan(
            {"zero_optimization": {"stage": stage}}, default_options(accumulation=3, precision=precision,
                                                                      backward="torch")))
            for stage, precision in itertools.product((1, 2, 3), ("fp32", "bf16"))]
        return plans + [("fp16 ZeRO-2 GA 3 static 128, engine.scale(loss).backward()", build_plan(
            {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 128}},
            default_options(accumulation=3, backward="torch")))]
    if loop == "accelerate":
        return [(f"ZeRO-{stage} GA 3, no accumulate()", build_plan(
            {"zero_optimization": {"stage": stage}}, default_options(loop=loop, accumulation=3, accumulate=False)))
            for stage in (0, 1, 2, 3)] + [(f"ZeRO-{stage} GA 3, clip_grad_norm_(0.3) under clipping 1.0", build_plan(
                {"zero_optimization": {"stage": stage}, "gradient_clipping": 1.0},
                default_options(loop=loop, accumulation=3, clip_call=0.3))) for stage in (1, 2)]
    return []


def quiet_two_ranks(loop):
    """ZeRO-2 at GA 3 and ZeRO-3 at GA 1 on two ranks (one job for both) train, with DSPATCH=1, as plain torch."""
    from dspatch.canary.plan import build_plan, default_options

    matrix = [(f"ZeRO-{stage} GA {ga}, 2 ranks", build_plan(
        {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto"}, default_options(loop=loop, accumulation=ga, ranks=2)))
        for stage, ga in ((2, 3), (3, 1))]
    return _judged(matrix)


def pipeline_configurations():
    """[(label, plan)] of the pipeline loop (2 stages on 2 ranks): ZeRO-0/1 x GA 1/3 x fp32/bf16 x clipping, and ZeRO-1
    at GA 3 with the optimizer offloaded, on latest; a sample elsewhere (ZeRO-0 in fp32 with clipping among it: the
    canary found deepspeed/pipe-clip-norm-stages there)."""
    from dspatch.canary.plan import build_plan, default_options

    found = []
    for stage, ga, precision, offload, clip in itertools.product((0, 1), (1, 3), ("fp32", "bf16"), (False, True),
                                                                   (False, True)):
        if (stage == 0 and offload) or (offload and ga == 1):
            continue
        if STACK not in FULL and not (ga == 3 and clip and not offload and (stage == 1 or precision == "fp32")):
            continue
        config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
                  "gradient_clipping": 0.5 if clip else 0.0}
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        found.append((f"pipeline ZeRO-{stage} GA {ga} {precision}{' offload' if offload else ''}"
                      f"{' clip' if clip else ''}", build_plan(
            config, default_options(loop="pipeline", ranks=2, accumulation=ga, precision=precision))))
    return found


def fp16_configurations():
    """[(label, plan)] of fp16's loss scaler on latest, engine loop: ZeRO 1-3, each with a dynamic scale from 2^16 at
    GA 1 (the first steps overflow, hysteresis 2), a static 128 at GA 3, and 2^32 with consecutive hysteresis at GA 3
    (every compared step overflows and is skipped), clipping at 1.0."""
    from dspatch.canary.plan import build_plan, default_options

    scalers = {"dynamic 2^16": {"initial_scale_power": 16}, "static 128": {"loss_scale": 128},
               "dynamic 2^32": {"initial_scale_power": 32, "consecutive_hysteresis": True}}
    # each stage at GA 1 and 3 with every scaler once between them (9 runs: the scaler is the stage's own code)
    return [(f"fp16 ZeRO-{stage} GA {ga} {name}", build_plan(
        {"zero_optimization": {"stage": stage}, "fp16": {"enabled": True, **scaler}, "gradient_clipping": 1.0},
        default_options(accumulation=ga)))
        for stage, (ga, (name, scaler)) in itertools.product((1, 2, 3), zip((1, 3, 3), scalers.items()))]


def quiet(loop):
    """Every configuration of the matrix trains, with DSPATCH=1, as plain torch (one DeepSpeed interpreter for all)."""
    return _judged(configurations(loop))


def quiet_pipeline():
    """The pipeline loop's matrix trains, with DSPATCH=1, as plain torch (one 2-rank job for all)."""
    return _judged(pipeline_configurations())


def _judged(matrix):
    """The matrix's runs, with DSPATCH=1, one DeepSpeed interpreter (or job) for all: none diverges."""
    from dspatch.canary import deepspeed_side, judge
    from dspatch.canary.runner import UNMODELLED

    env = clean_env(DSPATCH="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    records = deepspeed_side([plan for _, plan in matrix], env)
    # a configuration the stack cannot run as planned is said so by the canary (exit 2), not judged: only the
    # Trainer in bf16 on the CPU before transformers runs DeepSpeed with use_cpu
    unmodelled = [label for (label, _), record in zip(matrix, records) if UNMODELLED in (record["error"] or "")]
    assert all(plan["loop"] == "trainer" and "bf16" in label for label, plan in matrix if label in unmodelled), \
        unmodelled
    loud = {label: judge(plan, record) for (label, plan), record in zip(matrix, records) if label not in unmodelled}
    loud = {label: f"step {found['step']} ({found['what']}): {found['words'][:300]}"
            for label, found in loud.items() if found}
    assert not loud, loud
    return len(matrix)
