"""How `dspatch canary` reads a config (issue 57, dspatch/canary/reading.py): batch sizes for the user's world size
(torch-free), and with the stack, "auto" filled by the Trainer's own code, accelerate YAML through accelerate's own
loader, and the Trainer's loop given the config's explicit values (so that its own check passes where the user's
does, and an option that contradicts the config is its own error)."""
import argparse
import json

import pytest

from conftest import STACK


def _plan(tmp_path, config, *args, name="ds_config.json"):
    from dspatch import canary

    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    parsed = canary.arguments(argparse.ArgumentParser()).parse_args([str(path), *args])
    config, facts = canary.read(str(path))
    return canary.build_plan(config, canary._options(parsed, facts))


@pytest.mark.unit_only
@pytest.mark.parametrize("config,options,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}, {},
     (1, 1, 32)),  # the world size it implies
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, {"world_size": 4}, (2, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": "8"}, {"world_size": 2}, (2, 8, 2)),
    ({"train_batch_size": 16}, {}, (16, 1, 1)),  # DeepSpeed's rule: accumulation 1, the rest the micro batch
    ({"train_batch_size": "auto", "gradient_accumulation_steps": 1e1}, {}, (1, 10, 1)),
    ({}, {"micro_batch": 2, "accumulation": 3, "given": ["micro_batch", "accumulation"]}, (2, 3, 1))])
def test_batch_sizes_for_the_users_world_size(config, options, want):
    from dspatch.canary.plan import default_options
    from dspatch.canary.reading import batch

    config = dict(config)
    micro, ga, world, _ = batch(config, {**default_options(), **options}, 1)
    assert (micro, ga, world) == want
    if "train_batch_size" in config:  # rewritten for the canary's own ranks
        assert config["train_batch_size"] == micro * ga


@pytest.mark.unit_only
@pytest.mark.parametrize("config,options,why", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
     {"world_size": 8}, "train_batch_size 32 is not micro batch 1 x accumulation 1 x world size"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, {}, "not a multiple of 4"),
    ({"gradient_accumulation_steps": "eight"}, {}, "is not a positive whole number"),
    ({"train_micro_batch_size_per_gpu": 0}, {}, "is not a positive whole number")])
def test_batch_sizes_deepspeed_would_refuse_are_said(config, options, why):
    from dspatch.canary.plan import default_options
    from dspatch.canary.reading import Unmodelled, batch

    with pytest.raises(Unmodelled, match=why):
        batch(dict(config), {**default_options(), **options}, 1)


@pytest.mark.stack
@pytest.mark.skipif(STACK not in ("latest", "mid", "old"), reason="the reading on three matrix stacks")
def test_auto_is_what_the_trainer_puts_there(tmp_path):
    """Every "auto" the Trainer fills is filled in the engine loop as the Trainer would fill it: clipping from
    max_grad_norm (not 0: the false "new bug" of issue 57), the optimizer's and scheduler's values, precision, ZeRO's
    hidden-size buckets from the tiny model; ZeRO's explicit sizes scaled to the tiny model."""
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9},
              "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}},
              "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    plan = _plan(tmp_path, config, "--ga", "3", "--lr", "0.02", "--bf16")
    filled = plan["config"]
    assert filled["gradient_clipping"] == 1.0 and plan["clip"] == 1.0
    assert filled["optimizer"]["params"]["lr"] == 0.02 and filled["optimizer"]["params"]["weight_decay"] == 0.0
    assert list(filled["optimizer"]["params"]["betas"]) == [0.9, 0.999]
    assert filled["scheduler"]["params"]["total_num_steps"] == 4 and filled["scheduler"]["params"]["warmup_max_lr"] == 0.02
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False and plan["precision"] == "bf16"
    assert filled["zero_optimization"]["reduce_bucket_size"] == 16 * 16
    assert filled["zero_optimization"]["stage3_param_persistence_threshold"] == 160
    assert filled["train_batch_size"] == 3 and filled["gradient_accumulation_steps"] == 3
    assert 0 < filled["zero_optimization"]["sub_group_size"] < 1e9  # about the user's model: scaled to the tiny one
    assert "auto" not in json.dumps(filled)


@pytest.mark.stack
@pytest.mark.skipif(STACK not in ("latest", "mid"), reason="the Trainer's check on two matrix stacks")
def test_the_trainer_loop_takes_the_configs_values_and_refuses_a_contradiction(tmp_path):
    from dspatch.canary.plan import Unmodelled

    for clip in (0.0, 0.5, 1.0):  # the Trainer's own check passes: max_grad_norm is the config's
        plan = _plan(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": clip}, "--loop", "trainer")
        assert plan["trainer_args"]["max_grad_norm"] == clip and plan["clip"] == clip
    values = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    plan = _plan(tmp_path, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": values}},
                 "--loop", "trainer")
    assert (plan["trainer_args"]["learning_rate"], plan["trainer_args"]["adam_beta1"],
            plan["trainer_args"]["adam_epsilon"], plan["trainer_args"]["weight_decay"]) == (0.01, 0.8, 1e-6, 0.1)
    with pytest.raises(Unmodelled, match="ds gradient_clipping=0.0 vs hf max_grad_norm=1.0"):
        _plan(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0}, "--loop", "trainer",
              "--max-grad-norm", "1.0")


@pytest.mark.stack
@pytest.mark.skipif(STACK != "latest", reason="the Trainer's loop on the latest stack")
def test_the_trainer_loop_with_the_configs_own_values_trains_as_plain_torch(tmp_path):
    """Clipping 0.0, 0.5, 1.0 and an optimizer and scheduler of the config's own values, through the Trainer (one
    DeepSpeed interpreter), with DSPATCH=1."""
    from canary_matrix import _judged

    matrix = [(f"clip {clip}", _plan(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": clip},
                                     "--loop", "trainer", "--ga", "3")) for clip in (0.0, 0.5, 1.0)]
    matrix.append(("optimizer and scheduler", _plan(tmp_path, {
        "zero_optimization": {"stage": 2}, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 3}}}, "--loop", "trainer")))
    assert _judged(matrix) == 4


@pytest.mark.stack
@pytest.mark.skipif(STACK not in ("latest", "mid"), reason="accelerate's loader on two matrix stacks")
def test_an_accelerate_yaml_is_read_by_accelerates_own_code(tmp_path):
    """Inline fields through DeepSpeedPlugin (its loop accelerate's, its num_processes the world size, its
    mixed_precision the "auto" precision); a deepspeed_config_file resolved beside the YAML; a YAML of another
    distributed type refused in one line."""
    from dspatch.canary.plan import Unmodelled

    inline = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
              "  gradient_accumulation_steps: 4\n  gradient_clipping: 0.5\n  offload_optimizer_device: cpu\n"
              "  zero_stage: 2\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 8\n")
    plan = _plan(tmp_path, inline, name="zero2.yaml")
    assert (plan["loop"], plan["stage"], plan["accumulation"], plan["clip"], plan["precision"], plan["world_size"],
            plan["offloaded"]) == ("accelerate", 2, 4, 0.5, "bf16", 8, True)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
                                                  "train_micro_batch_size_per_gpu": "auto"}))
    plan = _plan(tmp_path, "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
                 "num_processes: 2\n", name="file.yaml")
    assert (plan["stage"], plan["clip"], plan["world_size"]) == (3, 1.0, 2)
    with pytest.raises(Unmodelled, match="distributed_type MULTI_GPU, not DEEPSPEED"):
        _plan(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\n", name="ddp.yaml")


@pytest.mark.unit_only
def test_a_misspelt_option_is_refused_not_run_as_another_plan():
    from dspatch.canary.plan import default_options

    with pytest.raises(TypeError, match="unknown canary options: accumulations"):
        default_options(accumulations=2)
    # `backward` is an option (engine or torch) and `backwards` a count: one given for the other is refused too
    with pytest.raises(TypeError, match="backward: 'engine' or 'torch', not 2"):
        default_options(backward=2)
