"""What a canary run trains: the user's DeepSpeed config with its "auto" values filled, and everything both sides of the
comparison need to train the same thing (the loop, the data, the optimizer, the schedule, the precision).

A plan is plain JSON (it crosses into the interpreter that runs DeepSpeed). Nothing here imports torch.
"""
import json
import os

from dspatch.canary import reading
from dspatch.canary.reading import Unmodelled, read  # noqa: F401 (the command's and the tests' names for them)

LOOPS = ("engine", "accelerate", "trainer", "pipeline")
HEADS = ("causal", "sequence", "token")
MODELS = ("llama", "moe")
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}  # DeepSpeed's names the reference models
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
TRAINER_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
EPOCHS = 2
LARGE = 8  # micro-batches a step from which a run compares its first steps only unless --steps says otherwise


_get, _explicit = reading.get, reading.explicit


def _refuse(config, options):
    """Why this config and these options cannot be modelled, or None."""
    stage = _explicit(config, "zero_optimization.stage") or 0
    fp16 = _get(config, "fp16.enabled")
    if options.get("loop") == "trainer" and (fp16 is True or (fp16 in ("auto", None) and
                                                             options.get("precision") == "fp16")):
        return ("fp16 with --loop trainer is not modelled: TrainingArguments refuses fp16 without a GPU (the engine "
                "and accelerate loops model it)")
    if _get(config, "fp16.fp16_master_weights_and_grads") is True:
        return ("fp16_master_weights_and_grads is not modelled: it needs DeepSpeedCPUAdam, a compiled op the canary "
                "does not build (it trains with torch's Adam)")
    optimizer = _get(config, "optimizer.type")
    if optimizer is not None and str(optimizer).lower() not in OPTIMIZERS:
        return f"the optimizer {optimizer!r} is not modelled (SGD, Adam, AdamW are)"
    scheduler = _get(config, "scheduler.type")
    if scheduler is not None and scheduler not in SCHEDULERS:
        return f"the scheduler {scheduler!r} is not modelled ({', '.join(SCHEDULERS)} are)"
    if scheduler == "OneCycle":
        given = _get(config, "scheduler.params") or {}
        if any(given.get(key) in (None, "auto") for key in ("cycle_min_lr", "cycle_max_lr")) or \
                "auto" in given.values():
            return "OneCycle is modelled with its values given (cycle_min_lr, cycle_max_lr; no \"auto\")"
        if given.get("last_batch_iteration", -1) != -1:
            return "OneCycle resumed mid-schedule (last_batch_iteration) is not modelled"
        if any(isinstance(value, list) for value in given.values()) and version_of("deepspeed") < (0, 19, 6):
            return "OneCycle with a value per param group is not modelled before deepspeed 0.19.6 (which reads them)"
    if options.get("loop") == "pipeline":
        why = _refuse_pipeline(config, options, stage)
        if why:
            return why
    elif _get(config, "pipeline") or _get(config, "pipeline_parallel_size"):
        return "a pipeline config: give --loop pipeline (the other loops train one stage)"
    if _get(config, "zero_optimization.offload_optimizer.device") == "nvme" or \
            _get(config, "zero_optimization.offload_param.device") == "nvme":
        return "NVMe offload is not modelled"
    if stage not in (0, 1, 2, 3):
        return f"ZeRO stage {stage!r} is not one of 0-3"
    return None


def _refuse_pipeline(config, options, stage):
    """Why the pipeline loop cannot model this, or None: DeepSpeed pipelines ZeRO-0/1 only; the canary's pipeline
    is one stage per rank (no data parallelism beside it), one param group, its own token model."""
    if stage not in (0, 1):
        return f"a pipeline trains at ZeRO-0 or 1 (DeepSpeed refuses ZeRO-{stage} with pipeline parallelism)"
    if options["ranks"] < 2:
        return "a pipeline of one stage is the engine loop: --loop pipeline runs 2 stages on --ranks 2"
    if options["group_lrs"]:
        return "--group-lrs with --loop pipeline is not modelled (one param group)"
    if options["model"] != "llama" or options["head"] != "causal":
        return "--loop pipeline trains its own token model (embedding, Linear-Tanh, head): no --model or --head"
    return None


def _precision(config, options):
    """fp32, bf16 or fp16: what the config enables, or for "auto" (or no block) what the options say (--bf16,
    --fp16, an accelerate YAML's mixed_precision); the option's block is added where the config has none."""
    wanted = options.get("precision") or "fp32"
    for name in ("bf16", "fp16"):
        if _get(config, f"{name}.enabled") is True:  # what the config enables, whatever the options
            return name
    if wanted in ("bf16", "fp16") and wanted not in config and "bfloat16" not in config:
        config[wanted] = {"enabled": True}
    return wanted if _get(config, f"{wanted}.enabled") in (True, "auto") else "fp32"


def build_plan(config, options):
    """The run both sides train, from the user's config and the command's options. Raises Unmodelled.

    The config is read as the user's stack reads it (dspatch.canary.reading): the batch sizes for the user's world
    size, ZeRO's sizes scaled to the tiny model, "auto" filled by the Trainer's own code."""
    config = json.loads(json.dumps(config))  # a copy the filling may edit
    why = _refuse(config, options)
    if why:
        raise Unmodelled(why)
    loop = options["loop"]
    pipeline = loop == "pipeline"
    stages = options["ranks"] if pipeline else 1
    data_ranks = options["ranks"] // stages  # each stage a rank of its own: no data parallelism beside a pipeline
    micro, ga, world, read_words = reading.batch(config, options, data_ranks)
    for dotted, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", ga)):
        config.setdefault(dotted, "auto" if loop == "trainer" else value)
    precision = _precision(config, options)
    stage = _explicit(config, "zero_optimization.stage") or 0
    if precision == "fp16" and not stage:
        raise Unmodelled("fp16 at ZeRO-0 is not modelled (on the CPU its optimizer wrapper trains without the loss "
                         "scale the config means): ZeRO-1, 2 and 3 are")
    if options.get("backward") == "torch" and not stage:
        raise Unmodelled("--backward torch at ZeRO-0: DeepSpeed refuses loss.backward() there (a ZeRO optimizer "
                         "only); engine.backward(loss) is its loop")
    per_epoch = 2 * ga + 1 if ga > 1 else 3  # the accumulation never divides an epoch: a last partial window
    total = steps_taken(loop, per_epoch, ga, accumulate=options["accumulate"])
    steps, why_steps = options["steps"], None
    if not steps and "steps" not in options.get("given", ()) and ga * options["backwards"] >= LARGE:
        steps = 2  # a large accumulation: its first steps, within the minute
        why_steps = f"comparing the first {steps} optimizer steps (GA {ga}; --steps N for more)"
    # the raw engine and a pipeline stop after the steps compared (their windows are DeepSpeed's own count); the
    # Trainer and accelerate run their epochs, their windows' ends being what their loops decide
    early = steps if loop in ("engine", "pipeline") and steps and steps < total else None
    scaled, ratio = [], None
    if any(isinstance(_get(config, f"zero_optimization.{key}"), (int, float, str)) for key in reading.SIZE_KEYS):
        from dspatch.canary.model import parameter_count

        tiny = parameter_count("mlp" if pipeline else options["model"])
        user = options.get("model_params") or reading.DEFAULT_MODEL_PARAMETERS
        scaled = reading.scale_sizes(config, tiny, user)
        ratio = f"{tiny} parameters for your {user:g}{'' if options.get('model_params') else ' (--model-params)'}"
    values = reading.trainer_values(config, options, micro, ga, data_ranks, precision)
    given = json.loads(json.dumps(config))  # as the Trainer gets it: it fills "auto" itself
    from dspatch.canary.model import HIDDEN

    config, filled = reading.fill(config, values, HIDDEN, total, check=loop == "trainer")
    why = _refuse(config, options)  # what "auto" hid: an optimizer or scheduler named by the filling
    if why:
        raise Unmodelled(why)
    lr = float(_explicit(config, "optimizer.params.lr") or values["learning_rate"])
    for target in (config, given):
        if stage and target.get("zero_allow_untested_optimizer") is None:
            target["zero_allow_untested_optimizer"] = True
        optimizer = _get(target, "optimizer.type")
        if optimizer is not None and str(optimizer).lower() in ("adam", "adamw"):
            # the CPU has no fused Adam: torch's, the same update (DeepSpeed's `torch_adam`)
            target["optimizer"].setdefault("params", {})["torch_adam"] = True
        target.setdefault("steps_per_print", 10**9)
    offloaded = _get(config, "zero_optimization.offload_optimizer.device") == "cpu"
    if offloaded and _get(config, "optimizer.type") is None:
        for target in (config, given):
            target["zero_force_ds_cpu_optimizer"] = False  # the canary's client optimizer on the CPU, as the user's
    lrs = list(options["group_lrs"]) if options["group_lrs"] else [lr]
    if options["head"] != "causal" and loop != "trainer":
        raise Unmodelled("--head sequence/token is modelled with --loop trainer only")
    clip = _explicit(config, "gradient_clipping")
    return {"loop": loop, "config": config, "trainer_config": given if loop == "trainer" else None,
            "trainer_args": {k: v for k, v in values.items() if k != "world_size"},
            "model": "mlp" if pipeline else options["model"],
            "head": options["head"], "stages": stages, "data_ranks": data_ranks, "world_size": world,
            "micro": micro, "accumulation": ga, "per_epoch": per_epoch, "epochs": EPOCHS, "ranks": options["ranks"],
            "lrs": lrs, "precision": precision, "clip": None if clip is None else float(reading.number(clip)),
            "max_grad_norm": values["max_grad_norm"] if loop == "trainer" else None,
            "warmup_steps": values["warmup_steps"], "trainer_scheduler": options["scheduler"],
            "steps": steps, "early": early, "backwards": options["backwards"], "boundary_call": options["boundary_call"],
            "accumulate": options["accumulate"], "clip_call": options["clip_call"],
            "backward": options["backward"],
            "stage": stage, "offloaded": offloaded, "device": options.get("device", "cpu"), "seed": 0,
            "read": {"batch": read_words, "filled": filled, "scaled": scaled, "ratio": ratio, "steps_why": why_steps},
            "given": options.get("given", [])}


def deepspeed_counts(loop, accumulate=True):
    """Whether DeepSpeed's own count of micro-steps decides the loop's windows: the raw engine loop, a pipeline's
    train_batch, and an accelerate loop without `accumulate()` (which leaves the accumulation to DeepSpeed)."""
    return loop in ("engine", "pipeline") or (loop == "accelerate" and not accumulate)


def steps_taken(loop, per_epoch, ga, epochs=EPOCHS, accumulate=True):
    """The optimizer steps a loop takes over `epochs` of `per_epoch` micro-batches at accumulation `ga`: where DeepSpeed
    counts (deepspeed_counts), where its count says, over the whole stream (a last partial window is never applied);
    accelerate's `accumulate` and the Trainer end a window with each epoch."""
    if deepspeed_counts(loop, accumulate) or (loop == "trainer" and version_of("transformers") < (4, 47)):
        return (epochs * per_epoch) // ga
    return epochs * -(-per_epoch // ga)


def default_options(**given):
    """The command's options as plan() takes them, its defaults where not given."""
    options = {"loop": "engine", "ranks": 1, "steps": 6, "group_lrs": None, "micro_batch": 1, "accumulation": 1,
               "lr": 0.05, "max_grad_norm": 1.0, "warmup_steps": 0, "scheduler": "constant", "precision": "fp32",
               "model": "llama", "head": "causal", "backwards": 1, "boundary_call": False, "accumulate": True,
               "clip_call": None, "backward": "engine",
               "device": os.environ.get("DS_ACCELERATOR", "cpu"),
               "world_size": None, "model_params": None}
    unknown = sorted(set(given) - set(options) - {"given"})
    if unknown:  # a misspelt option would otherwise be a run of another plan, silently
        raise TypeError(f"unknown canary options: {', '.join(unknown)} (known: {', '.join(sorted(options))})")
    options.update(given)
    if options["backward"] not in ("engine", "torch"):  # not to be mistaken for `backwards`, a count
        raise TypeError(f"backward: 'engine' or 'torch', not {options['backward']!r} (backwards: the count)")
    options["given"] = sorted(set(given) - {"given"} | set(given.get("given", ())))
    return options


def version_of(distribution):
    """The installed release of `distribution` as a tuple of ints ((0,) when it is not installed)."""
    from dspatch.upstream import installed_version
    from dspatch.versions import InvalidVersion, Version

    found = installed_version(distribution)
    try:
        return Version(Version(found).base_version).release if found else (0,)
    except InvalidVersion:
        return (0,)
