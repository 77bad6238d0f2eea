"""The user's file read as their stack reads it, not by a copy of its rules:

- a DeepSpeed JSON config, or an accelerate YAML config (accelerate's own loader; its `deepspeed_config_file`, or the
  inline fields turned into a DeepSpeed config by accelerate's own `DeepSpeedPlugin`);
- the batch sizes for the user's world size: the config's micro batch and accumulation kept, what it leaves implied
  derived from `train_batch_size`, and `train_batch_size` rewritten for the canary's own ranks;
- "auto" filled by the Trainer's own code (transformers' `HfTrainerDeepSpeedConfig`, `trainer_config_process` and
  `trainer_config_finalize`) from TrainingArguments made of the options and the config's own explicit values: in
  every loop "auto" means what the Trainer would put there;
- sizes written for the user's model (ZeRO's thresholds and buckets) scaled to the tiny one.

Nothing here imports torch at module level; the filling imports transformers (and so torch) when it runs.
"""
import dataclasses
import json
import math
import os




class Unmodelled(ValueError):
    """The config asks for something the reference does not model, or is not a DeepSpeed config: exit 2, said."""


YAML_ENDINGS = (".yaml", ".yml")
# TrainingArguments' names of the values a DeepSpeed config can state itself (the Trainer checks they match)
TRAINER_KEYS = {"gradient_clipping": "max_grad_norm", "optimizer.params.lr": "learning_rate",
                "optimizer.params.eps": "adam_epsilon", "optimizer.params.weight_decay": "weight_decay",
                "scheduler.params.warmup_max_lr": "learning_rate", "scheduler.params.warmup_num_steps": "warmup_steps"}
# ZeRO's numbers about the user's model: an element count (what is kept whole, what a bucket holds)
SIZE_KEYS = ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "reduce_bucket_size",
             "allgather_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size",
             "stage3_model_persistence_threshold")
BUCKETS = ("sub_group_size", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
ALIGN = 8  # a multiple of every nccl_start_alignment_factor ZeRO-2 asserts a bucket size to be (2 in 16 bits)
DEFAULT_MODEL_PARAMETERS = 7e9  # a 7B-class model, where the user names none (--model-params)


def get(config, dotted, default=None):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def explicit(config, dotted):
    """The config's own value at `dotted`, or None where it says "auto" or nothing."""
    value = get(config, dotted)
    return None if value in (None, "auto") else value


def whole(value, what):
    """An explicit count (micro batch, accumulation, batch size) as DeepSpeed compares it: an int, an integral float
    (1e1) or a string of digits ("8"); None for "auto" or nothing."""
    if value in (None, "auto"):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Unmodelled(f"{what} {value!r} is not a positive whole number")
    return value


def read(path):
    """(the DeepSpeed config, what the file itself says of the job: {"world_size", "precision", "loop", "notes"}) of
    a JSON file or an accelerate YAML file; Unmodelled saying why it cannot be read."""
    if path.lower().endswith(YAML_ENDINGS):
        return _read_yaml(path)
    return _read_json(path), {}


def _read_json(path):
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


# the inline fields of an accelerate YAML's deepspeed_config, as `accelerate launch` hands them to DeepSpeedPlugin
PLUGIN_FIELDS = ("zero_stage", "gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device",
                 "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path", "zero3_init_flag",
                 "zero3_save_16bit_model")


def _read_yaml(path):
    """An accelerate config file, read by accelerate's own loader: its DeepSpeed config (the file it names, resolved
    as `accelerate launch` resolves it, from the working directory, else beside the YAML; or the inline fields through
    accelerate's DeepSpeedPlugin), its num_processes and mixed_precision."""
    if not os.path.exists(path):
        raise Unmodelled(f"cannot read {path}: No such file or directory")
    try:
        from accelerate.commands.config.config_args import load_config_from_file
        from accelerate.utils import DeepSpeedPlugin
    except ImportError:
        raise Unmodelled(f"{path} is an accelerate config: accelerate is not installed here") from None
    try:
        found = load_config_from_file(path)
    except Exception as e:  # yaml's own errors, a file of another kind
        raise Unmodelled(f"{path} is not an accelerate config: {str(e).splitlines()[0] if str(e) else e!r}") from None
    kind = str(getattr(found, "distributed_type", "")).split(".")[-1]
    fields = dict(getattr(found, "deepspeed_config", None) or {})
    if kind.upper() != "DEEPSPEED":
        raise Unmodelled(f"{path} is an accelerate config of distributed_type {kind or 'none'}, not DEEPSPEED")
    facts = {"loop": "accelerate", "notes": []}
    processes = getattr(found, "num_processes", None)
    if isinstance(processes, int) and processes > 0:
        facts["world_size"] = processes * max(1, int(getattr(found, "num_machines", 1) or 1))
    precision = str(getattr(found, "mixed_precision", "") or "").split(".")[-1].lower()
    if precision in ("fp16", "bf16"):
        facts["precision"] = precision
    named = fields.get("deepspeed_config_file")
    if named and named != "none":
        for where in (named, os.path.join(os.path.dirname(os.path.abspath(path)), named)):
            if os.path.exists(where):
                facts["notes"].append(f"deepspeed_config_file {named}")
                return _read_json(where), facts
        raise Unmodelled(f"{path} names deepspeed_config_file {named}, found neither in the working directory nor "
                         "beside it")
    given = {key: fields[key] for key in PLUGIN_FIELDS if fields.get(key) not in (None, "none", "None")}
    if given.get("gradient_clipping") is not None:
        given["gradient_clipping"] = float(given["gradient_clipping"])
    for key in ("offload_optimizer_device", "offload_param_device"):
        given.setdefault(key, "none")
    try:
        plugin = DeepSpeedPlugin(**given)
    except Exception as e:
        raise Unmodelled(f"accelerate refuses {path}'s deepspeed_config: {e}") from None
    config = json.loads(json.dumps(plugin.deepspeed_config, default=str).replace("Infinity", "1000000000"))
    facts["notes"].append("inline deepspeed_config (accelerate's DeepSpeedPlugin)")
    return config, facts


def batch(config, options, ranks):
    """(micro batch, accumulation, the user's world size, words) for a job of the user's world size N, and the config
    rewritten for the canary's `ranks`: the micro batch and accumulation the config states are kept (per-rank
    numerics are what the canary checks); what it leaves implied is derived as DeepSpeed derives it
    (train_batch_size / (micro x N)); `train_batch_size`, where the config has it, is rewritten for `ranks`."""
    micro = whole(get(config, "train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu")
    ga = whole(get(config, "gradient_accumulation_steps"), "gradient_accumulation_steps")
    total = whole(get(config, "train_batch_size"), "train_batch_size")
    world = options.get("world_size")
    words = []
    if total is not None:
        if micro is not None and ga is not None:
            implied, rest = divmod(total, micro * ga)
            if rest or (world and implied != world):
                raise Unmodelled(f"DeepSpeed refuses this config at world size {world or implied}: train_batch_size "
                                 f"{total} is not micro batch {micro} x accumulation {ga} x world size")
            world = implied
            words.append(f"world size {world} (train_batch_size {total} / ({micro} x {ga}))")
        else:
            world = world or 1
            if micro is None and ga is None:  # DeepSpeed's rule: the accumulation 1 unless said (--ga here)
                ga = options["accumulation"] if "accumulation" in options.get("given", ()) else 1
            known = micro if micro is not None else ga
            other, rest = divmod(total, known * world)
            if rest or other < 1:
                raise Unmodelled(f"DeepSpeed refuses this config at world size {world}: train_batch_size {total} is "
                                 f"not a multiple of {known} x world size {world}")
            if micro is None:
                micro = other
                words.append(f"micro batch {micro} (train_batch_size {total} / ({ga} x {world}))")
            else:
                ga = other
                words.append(f"accumulation {ga} (train_batch_size {total} / ({micro} x {world}))")
    micro = micro if micro is not None else options["micro_batch"]
    ga = ga if ga is not None else options["accumulation"]
    world = world or 1
    if "train_batch_size" in config:
        config["train_batch_size"] = micro * ga * ranks
        if total is not None and total != micro * ga * ranks:
            words.append(f"train_batch_size {total} run as {micro * ga * ranks} on {ranks} "
                         f"rank{'s' * (ranks > 1)}")
    return micro, ga, world, words


def _training_arguments(values):
    """A stand-in for TrainingArguments that the Trainer's filling code reads: every field at TrainingArguments' own
    default, `values` over them, and its own get_warmup_steps (a real TrainingArguments would check the device: fp16
    and bf16 need a GPU or use_cpu, which says no DeepSpeed on some releases)."""
    import types

    from transformers import TrainingArguments

    args = types.SimpleNamespace()
    for field in dataclasses.fields(TrainingArguments):
        if field.default is not dataclasses.MISSING:
            setattr(args, field.name, field.default)
        elif field.default_factory is not dataclasses.MISSING:
            setattr(args, field.name, field.default_factory())
    for key, value in values.items():
        setattr(args, key, value)
    args.get_warmup_steps = types.MethodType(TrainingArguments.get_warmup_steps, args)
    return args


def trainer_values(config, options, micro, ga, ranks, precision):
    """The TrainingArguments of the run: the config's explicit values where it states them (so that the Trainer's own
    consistency check passes where the user's does), the command's options where the user gave them (so that a
    contradiction is the Trainer's own error), the canary's defaults for the rest."""
    given = options.get("given", ())
    values = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": ga, "world_size": ranks,
              "num_train_epochs": options.get("epochs", 2), "lr_scheduler_type": options["scheduler"],
              "fp16": precision == "fp16", "bf16": precision == "bf16"}
    stated = {}
    for key, name in TRAINER_KEYS.items():  # the optimizer's rate before the scheduler's peak
        if stated.get(name) is None:
            stated[name] = explicit(config, key)
    defaults = {"max_grad_norm": options["max_grad_norm"], "learning_rate": options["lr"],
                "warmup_steps": options["warmup_steps"]}
    for name, option in (("max_grad_norm", "max_grad_norm"), ("learning_rate", "lr"),
                         ("warmup_steps", "warmup_steps")):
        if option in given:
            values[name] = options[option]
        elif stated.get(name) is not None:
            values[name] = number(stated[name])
        else:
            values[name] = defaults[name]
    for name in ("adam_epsilon", "weight_decay"):
        if stated.get(name) is not None:
            values[name] = number(stated[name])
    betas = explicit(config, "optimizer.params.betas")
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        values["adam_beta1"], values["adam_beta2"] = (number(b) for b in betas)
    if isinstance(values["warmup_steps"], float) and values["warmup_steps"].is_integer():
        values["warmup_steps"] = int(values["warmup_steps"])
    return values


def number(value):
    """A number as the config states it ("1e-5" and 3e-5 alike)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def fill(config, values, hidden, steps, check):
    """`config` with "auto" filled by the Trainer's own code from TrainingArguments `values`, for a model of hidden
    size `hidden` trained `steps` optimizer steps. With `check` (the Trainer's loop), a value the config states that
    TrainingArguments contradicts is the Trainer's own ValueError, as Unmodelled; the other loops take the config's
    values as DeepSpeed does. Returns (the filled config, [(key, value)] of what was filled)."""
    import types

    from transformers.integrations import deepspeed as hf_deepspeed

    before = json.loads(json.dumps(config))
    filler = hf_deepspeed.HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
    try:
        args = _training_arguments(values)
        filler.trainer_config_process(args)
        if not check:
            filler.mismatches = []
        model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden))
        try:
            filler.trainer_config_finalize(args, model, steps)
        except ValueError as e:
            message = " ".join(str(e).split("\n")[:3])
            raise Unmodelled(f"the Trainer refuses this config with these options: {message}") from None
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
    # only what said "auto" takes the Trainer's value: nothing the filling adds beside it (a checkpoint block, or a
    # patch's own addition in a patched process) becomes the config of a loop that is not the Trainer's
    result, autos = json.loads(json.dumps(before)), _autos(before)
    for key in autos:
        *path, last = key.split(".")
        node = result
        for part in path:
            node = node[part]
        node[last] = get(filler.config, key)
    return result, [(key, get(result, key)) for key in autos]


def source(key, given):
    """Where the Trainer's code took a filled value from, in a few words (`given`: the options the user gave)."""
    last = key.split(".")[-1]
    option = {"train_micro_batch_size_per_gpu": ("micro_batch", "--micro-batch", "the canary's 1"),
              "gradient_accumulation_steps": ("accumulation", "--ga", "the canary's 1"),
              "gradient_clipping": ("max_grad_norm", "--max-grad-norm", "max_grad_norm's default"),
              "lr": ("lr", "--lr", "the canary's 0.05"), "warmup_max_lr": ("lr", "--lr", "the canary's 0.05"),
              "warmup_num_steps": ("warmup_steps", "--warmup-steps", "no warmup"),
              "enabled": ("precision", "--bf16/--fp16 or mixed_precision", "fp32")}.get(last)
    if option:
        return option[1] if option[0] in given else option[2]
    if last in ("betas", "eps", "weight_decay"):
        return "TrainingArguments' default"
    if last in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        return "the tiny model's hidden size"
    if last == "total_num_steps":
        return "the run's steps"
    if last == "train_batch_size":
        return "micro x GA x ranks"
    return "the Trainer's"


def _autos(config, prefix=""):
    """The dotted keys of `config` that say "auto"."""
    found = []
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            found += _autos(value, dotted + ".")
        elif value == "auto":
            found.append(dotted)
    return found


def scale_sizes(config, tiny, user):
    """ZeRO's sizes written for the user's model (`user` parameters) scaled to the tiny one (`tiny`), so that what
    is partitioned, bucketed or kept whole in the user's model is so in the tiny one. [(key, was, now)]."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    ratio = tiny / user
    scaled = []
    for key in SIZE_KEYS:
        value = zero.get(key)
        if isinstance(value, str):
            value = number(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            continue
        now = int(math.floor(value * ratio))
        if key in BUCKETS:  # a bucket holds something, in whole alignment units (ZeRO-2 asserts them)
            now = max(ALIGN, -(-now // ALIGN) * ALIGN)
        zero[key] = now
        scaled.append((key, value, now))
    return scaled
