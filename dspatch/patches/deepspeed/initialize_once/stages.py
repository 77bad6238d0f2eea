"""The ZeRO stage of a call to deepspeed.initialize and of a live engine, read without side effects, and whether that
stage installs per-parameter state: what decides between refusing a second call and letting it through."""


def read_config(args, config, config_params):
    """The config dict as deepspeed.initialize will pick it, or None if it cannot be read without side effects."""
    import json
    import os

    if config is None and config_params is not None:
        config = config_params
    for name in ("deepscale_config", "deepspeed_config"):
        if getattr(args, name, None) is not None:
            config = getattr(args, name)
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        try:
            with open(config) as f:
                value = json.load(f)
            return value if isinstance(value, dict) else None
        except (OSError, ValueError):
            return None
    return None


def stage_of_config(config):
    """(stage, overlap_comm) or None when unknown ("auto", unreadable)."""
    if config is None:
        return None
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        return None
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int):
        return None
    return stage, bool(zero.get("overlap_comm") is True)


def stage_of_engine(engine):
    try:
        return engine.zero_optimization_stage(), bool(engine.zero_overlap_comm())
    except Exception:
        return None


def has_hooks(stage):
    """Whether an engine at this (stage, overlap_comm) installs per-parameter state (grad hooks, partitions)."""
    return stage is None or stage[0] >= 2 or (stage[0] == 1 and stage[1])
