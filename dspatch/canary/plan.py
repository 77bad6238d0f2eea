"""What a canary run trains: the user's DeepSpeed config with its "auto" values filled, and everything both sides of the
comparison need to train the same thing (the loop, the data, the optimizer, the schedule, the precision).

A plan is plain JSON (it crosses into the interpreter that runs DeepSpeed). Nothing here imports torch.
"""
import json
import os

LOOPS = ("engine", "accelerate", "trainer", "pipeline")
HEADS = ("causal", "sequence", "token")
MODELS = ("llama", "moe")
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}  # DeepSpeed's names the reference models
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
TRAINER_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
EPOCHS = 2


class Unmodelled(ValueError):
    """The config asks for something the reference does not model, or is not a DeepSpeed config: exit 2, said."""


def read(path):
    """The user's DeepSpeed config (a JSON file), or Unmodelled saying why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise Unmodelled(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise Unmodelled(f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise Unmodelled(f"{path} holds a JSON {type(config).__name__}, not a DeepSpeed config (an object)")
    return config


def _get(config, dotted, default=None):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _explicit(config, dotted):
    value = _get(config, dotted)
    return None if value in (None, "auto") else value


def _set_auto(config, dotted, value):
    """Fill `dotted` with `value` where the config says "auto" (as the Trainer and accelerate do)."""
    *path, last = dotted.split(".")
    node = config
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return
    if node.get(last) == "auto":
        node[last] = value


def _refuse(config, options):
    """Why this config and these options cannot be modelled, or None."""
    stage = _explicit(config, "zero_optimization.stage") or 0
    if _get(config, "fp16.enabled") in (True, "auto") and options.get("precision") != "bf16":
        if _get(config, "fp16.enabled") is True:
            return "fp16 is not modelled (and DeepSpeed refuses it on the CPU): use bf16 or fp32"
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


def build_plan(config, options):
    """The run both sides train, from the user's config and the command's options. Raises Unmodelled."""
    config = json.loads(json.dumps(config))  # a copy the filling may edit
    why = _refuse(config, options)
    if why:
        raise Unmodelled(why)
    micro = _explicit(config, "train_micro_batch_size_per_gpu") or options["micro_batch"]
    ga = _explicit(config, "gradient_accumulation_steps") or options["accumulation"]
    if not isinstance(micro, int) or not isinstance(ga, int) or micro < 1 or ga < 1:
        raise Unmodelled(f"micro batch {micro!r} and accumulation {ga!r} must be positive integers")
    lr = _explicit(config, "optimizer.params.lr") or options["lr"]
    if options["precision"] == "bf16" and "bf16" not in config:  # --bf16 with a config that says nothing of it
        config["bf16"] = {"enabled": True}
    bf16 = _get(config, "bf16.enabled")
    precision = "bf16" if bf16 is True or (bf16 == "auto" and options["precision"] == "bf16") else "fp32"
    clip = _explicit(config, "gradient_clipping")
    max_grad_norm = options["max_grad_norm"] if options["loop"] == "trainer" else None
    per_epoch = 2 * ga + 1 if ga > 1 else 3  # the accumulation never divides an epoch: a last partial window
    total = steps_taken(options["loop"], per_epoch, ga)
    warmup = options["warmup_steps"]
    # a config that leaves the batch out gets it as its loop's user passes it: the Trainer fills "auto" from
    # TrainingArguments, the other loops from the options
    pipeline = options["loop"] == "pipeline"
    stages = options["ranks"] if pipeline else 1
    data_ranks = options["ranks"] // stages  # each stage a rank of its own: no data parallelism beside a pipeline
    for dotted, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", ga)):
        config.setdefault(dotted, "auto" if options["loop"] == "trainer" else value)
    if options["loop"] != "trainer":  # the Trainer fills these itself, from TrainingArguments
        for dotted, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", ga),
                              ("train_batch_size", micro * ga * data_ranks), ("optimizer.params.lr", lr),
                              ("scheduler.params.warmup_max_lr", lr), ("scheduler.params.warmup_min_lr", 0),
                              ("scheduler.params.warmup_num_steps", max(1, warmup)),
                              ("scheduler.params.total_num_steps", total), ("gradient_clipping", 0.0),
                              ("bf16.enabled", precision == "bf16")):
            _set_auto(config, dotted, value)
    config.setdefault("steps_per_print", 10**9)
    stage = _explicit(config, "zero_optimization.stage") or 0
    if stage and config.get("zero_allow_untested_optimizer") is None:
        config["zero_allow_untested_optimizer"] = True
    optimizer = _get(config, "optimizer.type")
    if optimizer is not None and str(optimizer).lower() in ("adam", "adamw"):
        # the CPU has no fused Adam: torch's, the same update (DeepSpeed's `torch_adam`)
        config["optimizer"].setdefault("params", {})["torch_adam"] = True
    offloaded = _get(config, "zero_optimization.offload_optimizer.device") == "cpu"
    if offloaded and optimizer is None:
        config["zero_force_ds_cpu_optimizer"] = False  # the canary's client optimizer on the CPU, as the user's
    lrs = [lr, *(options["group_lrs"][1:] if options["group_lrs"] else [])]
    if options["group_lrs"]:
        lrs = list(options["group_lrs"])
    if options["head"] != "causal" and options["loop"] != "trainer":
        raise Unmodelled("--head sequence/token is modelled with --loop trainer only")
    return {"loop": options["loop"], "config": config, "model": "mlp" if pipeline else options["model"],
            "head": options["head"], "stages": stages, "data_ranks": data_ranks,
            "micro": micro, "accumulation": ga, "per_epoch": per_epoch, "epochs": EPOCHS, "ranks": options["ranks"],
            "lrs": lrs, "precision": precision, "clip": clip, "max_grad_norm": max_grad_norm,
            "warmup_steps": warmup, "trainer_scheduler": options["scheduler"], "steps": options["steps"],
            "backwards": options["backwards"], "boundary_call": options["boundary_call"], "stage": stage,
            "offloaded": offloaded, "device": options.get("device", "cpu"), "seed": 0}


def steps_taken(loop, per_epoch, ga, epochs=EPOCHS):
    """The optimizer steps a loop takes over `epochs` of `per_epoch` micro-batches at accumulation `ga`: the raw
    engine loop (and a pipeline's train_batch) steps where DeepSpeed's own count says, over the whole stream (a last
    partial window is never applied); accelerate's `accumulate` and the Trainer end a window with each epoch."""
    if loop in ("engine", "pipeline") or (loop == "trainer" and version_of("transformers") < (4, 47)):  # the Trainer's own count
        return (epochs * per_epoch) // ga
    return epochs * -(-per_epoch // ga)


def default_options(**given):
    """The command's options as plan() takes them, its defaults where not given."""
    options = {"loop": "engine", "ranks": 1, "steps": 6, "group_lrs": None, "micro_batch": 1, "accumulation": 1,
               "lr": 0.05, "max_grad_norm": 1.0, "warmup_steps": 0, "scheduler": "constant", "precision": "fp32",
               "model": "llama", "head": "causal", "backwards": 1, "boundary_call": False,
               "device": os.environ.get("DS_ACCELERATOR", "cpu")}
    options.update(given)
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
