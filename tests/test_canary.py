"""`dspatch canary` (issue 50): the user's DeepSpeed config, trained through DeepSpeed and through plain torch, compared
step by step. On each stack every silent bug listed there is caught with every patch but its own (exit 1, its shape,
its patch named) and with DSPATCH=1 (exit 0); bad input is one line and exit 2; the quiet matrices are tests/test_canary_quiet*.py.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import clean_env, run_python

COMMAND = os.path.join(os.path.dirname(sys.executable), "dspatch")
Z2 = {"zero_optimization": {"stage": 2}}


def canary(tmp_path, config, *args, env=None):
    path = tmp_path / "ds_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return subprocess.run([COMMAND, "canary", str(path), *args], env=env or clean_env(), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=900)


@pytest.mark.unit_only
@pytest.mark.parametrize("config,args,why", [
    ("{not json", [], "is not JSON"), ("[1, 2]", [], "not a DeepSpeed config"),
    ({"fp16": {"enabled": True}}, ["--loop", "trainer"], "fp16 with --loop trainer is not modelled"),
    ({"optimizer": {"type": "Lamb"}}, [], "the optimizer 'Lamb' is not modelled"),
    ({"scheduler": {"type": "Cyclic"}}, [], "the scheduler 'Cyclic' is not modelled"),
    (Z2, ["--loop", "trainer", "--group-lrs", "0.1,0.01"], "--group-lrs with the Trainer is not modelled"),
    (Z2, ["--group-lrs", "0.1"], "give two rates"),
    (Z2, ["--boundary-call"], "give --backwards 2 or more"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": 0.1}}}, [],
     "OneCycle is modelled with its values given"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                   "last_batch_iteration": 5}}}, [], "resumed mid-schedule"),
    (Z2, ["--loop", "pipeline"], "a pipeline trains at ZeRO-0 or 1"),
    ({"zero_optimization": {"stage": 1}}, ["--loop", "pipeline", "--ranks", "1"], "a pipeline of one stage"),
    ({}, ["--loop", "pipeline", "--group-lrs", "0.1,0.01"], "--group-lrs with --loop pipeline"),
    ({}, ["--loop", "pipeline", "--model", "moe"], "trains its own token model"),
    ({"pipeline": {"activation_checkpoint_interval": 0}}, [], "give --loop pipeline"),
    (Z2, ["--world-size", "0"], "--world-size 0: give a positive number"), (Z2, ["--bf16", "--fp16"], "give one"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}, [], "NVMe offload is not modelled"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, [], "needs DeepSpeedCPUAdam"),
    ({"train_micro_batch_size_per_gpu": "two"}, [], "is not a positive whole number")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, config, args, why, monkeypatch):
    """Read before anything heavy: the unit session has no torch, so the check that torch is there comes first; the
    plan is judged here in-process."""
    import argparse

    from dspatch import canary

    path = tmp_path / "ds_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    args = canary.arguments(argparse.ArgumentParser()).parse_args([str(path), *args])
    with pytest.raises(canary.Unmodelled, match=why.replace("(", r"\(")):
        config, facts = canary.read(str(path))
        canary.build_plan(config, canary._options(args, facts))


@pytest.mark.unit_only
def test_every_shape_a_patch_declares_is_one_the_comparison_can_emit():
    """One table of shapes (dspatch.canary.verdict.SHAPES): each patch's `canary` shapes are in it, and each of its codes
    is one the comparison's code writes."""
    import inspect
    import re

    from dspatch import registry
    from dspatch.canary import verdict

    declared = {code for patch in registry.all_patches().values() for code in patch.canary}
    assert declared <= set(verdict.SHAPES), declared - set(verdict.SHAPES)
    code = inspect.getsource(verdict).split("SHAPES = {", 1)[0] + inspect.getsource(verdict).split("\n}\n", 1)[1]
    written = set(re.findall(r'"(\w+)"', code)) | set(re.findall(r"'(\w+)'", code))
    assert set(verdict.SHAPES) - {"crash"} <= written, set(verdict.SHAPES) - written


@pytest.mark.unit_only
def test_without_the_stack_it_says_what_is_missing(tmp_path):
    proc = canary(tmp_path, Z2)
    assert proc.returncode == 2 and "not installed for" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc
    missing = subprocess.run([COMMAND, "canary", str(tmp_path / "nope.json")], capture_output=True, text=True,
                             env=clean_env())
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


@pytest.mark.unit_only
def test_known_bugs_are_named_by_loop_and_shared_shapes_hedged():
    """A shape names only the bugs of the libraries the loop runs (the Trainer's clipping bug is no candidate for the
    engine, accelerate or a pipeline, and a pipeline's clipping is a shape of its own); where several bugs have the
    shape, DSPATCH=1 fixes it "if it is this one"."""
    from dspatch.canary import _lines, known_for

    clipping, on_a_pipeline = {"code": "clipping"}, {"code": "stage_clipping"}
    assert [b["id"] for b in known_for(clipping, {}, "trainer")] == ["transformers/deepspeed-max-grad-norm"]
    for loop in ("engine", "accelerate", "pipeline"):  # the Trainer's bug; the pipeline's has a shape of its own
        assert known_for(clipping, {}, loop) == [], loop
    assert [b["id"] for b in known_for(on_a_pipeline, {}, "pipeline")] == ["deepspeed/pipe-clip-norm-stages"]
    plan = {"loop": "engine", "stage": 2, "micro": 1, "accumulation": 3, "precision": "fp32", "ranks": 1, "offloaded": False,
            "lrs": [0.05], "backwards": 2, "boundary_call": False, "epochs": 2, "per_epoch": 7}
    candidates = [{"id": pid, "here": "applies", "applied": False, "fixes": True}
                  for pid in ("deepspeed/zero12-backward-twice", "deepspeed/zero12-offload-backward-twice")]
    found = {"step": 1, "what": "gradient", "code": "last_only", "words": "the gradient is ...", "known": candidates}
    text = "\n".join(_lines("ds.json", plan, [("stock", found, [], None)], 1e-5))
    assert text.count("DSPATCH=1 fixes it here, if it is this one") == 2, text
    alone = "\n".join(_lines("ds.json", plan, [("stock", {**found, "known": candidates[:1]}, [], None)], 1e-5))
    assert "DSPATCH=1 fixes it here)" in alone, alone
    # a candidate applied in the run beside one that is not: not this one, nothing to report
    mixed = [{**candidates[0], "applied": True}, candidates[1]]
    text = "\n".join(_lines("ds.json", plan, [("DSPATCH=1", {**found, "known": mixed}, [], None)], 1e-5))
    assert "applied in this run: not this one" in text and "please report" not in text, text


@pytest.mark.unit_only
def test_the_schedules_by_their_definitions():
    from dspatch.canary.schedules import deepspeed_betas, deepspeed_rates

    linear = deepspeed_rates({"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear",
                                                             "warmup_min_lr": 0.0}}, [0.1, 0.02], 6)
    assert linear[0] == [0.0, 0.0] and linear[2] == pytest.approx([0.025, 0.005]) and linear[5] == [0.1, 0.02]
    decay = deepspeed_rates({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6,
                                                                 "warmup_type": "linear"}}, [0.1], 7)
    assert [r[0] for r in decay] == pytest.approx([0.0, 0.0, 0.0005, 0.001, 0.00075, 0.0005, 0.00025])
    cosine = deepspeed_rates({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 4,
                                                                   "warmup_type": "linear"}}, [0.1, 0.02], 4)
    assert cosine[0] == [0.0, 0.0] and cosine[2] == pytest.approx([0.05, 0.01])
    # OneCycle: up over 2 iterations, down over 2, then decaying; the momentum the other way, as built at its minimum
    cycle = {"type": "OneCycle", "params": dict(ONE_CYCLE)}
    assert [r[0] for r in deepspeed_rates(cycle, [0.1], 7)] == pytest.approx(
        [0.001, 0.0055, 0.01, 0.0055, 0.001, 0.001 / 1.5, 0.0005])
    betas = deepspeed_betas(cycle, 1, 7)
    assert [b[0][0] for b in betas] == pytest.approx([0.8, 0.85, 0.8, 0.85, 0.9, 0.909, 0.918])
    assert all(b[0][1] == 0.99 for b in betas)
    stairs = {"type": "OneCycle", "params": {**ONE_CYCLE, "cycle_first_step_size": 4, "cycle_second_step_size": 4,
                                             "cycle_first_stair_count": 2, "decay_step_size": 0}}
    assert [r[0] for r in deepspeed_rates(stairs, [0.1], 10)] == pytest.approx(
        [0.001, 0.001, 0.0055, 0.0055, 0.01, 0.0055, 0.0055, 0.001, 0.001, 0.001])
    # an explicit null for the second count is "as many as the first", as an absent one
    assert deepspeed_rates({**stairs, "params": {**stairs["params"], "cycle_second_stair_count": None}}, [0.1], 10) \
        == deepspeed_rates(stairs, [0.1], 10)
    assert deepspeed_betas({**cycle, "params": {**ONE_CYCLE, "cycle_momentum": False}}, 1, 3) is None


ONE_CYCLE = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2, "cycle_second_step_size": 2,
             "decay_step_size": 1, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}


# (patch, loop and options, config, the shapes stock shows): every silent bug of the catalogues dspatch patches, as
# the canary catches it on a stack where it exists (the patch applies there)
CASES = {
    "deepspeed/zero2-offload-grad-accum": (["--ga", "3"], {"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}, "middle_dropped"),
    "deepspeed/zero2-grad-accum-last-microbatch": (["--ga", "3"], Z2, "last_only"),
    "deepspeed/output-hooks-gas-per-tensor": (["--ga", "3"], Z2, "divided_twice"),
    # out.loss.backward() on the engine's output: the logits divided again after the loss (0.18.3 on)
    "deepspeed/direct-backward-gas-per-tensor": (["--backward", "torch", "--ga", "3"], Z2, "torch_backward_divided"),
    # the Trainer's output holds the logits too: on 0.18.3 they are divided again (output-hooks-gas-per-tensor), and
    # either patch alone sets the Trainer right, so the stock run leaves both out (ALSO_OUT)
    "deepspeed/backward-scale-wrt-gas": (["--loop", "trainer", "--ga", "3"], Z2, "divided_twice"),
    "transformers/deepspeed-grad-accum-scale": (["--loop", "trainer", "--ga", "3"], Z2, "divided_twice"),
    "accelerate/deepspeed-ga-boundary": (["--loop", "accelerate", "--ga", "3"], Z2, "windows"),
    # the loop's accelerator.clip_grad_norm_(params, 0.01): DeepSpeed clips at its config's value (none or 1.0)
    "accelerate/deepspeed-clip-grad-norm": (["--loop", "accelerate", "--clip-call", "0.01"], Z2, "clip_call"),
    # accelerate >= 1.8 steps on every micro-batch of a loop without accumulate(): GA times the steps
    "accelerate/deepspeed-steps-without-accumulate": (["--loop", "accelerate", "--no-accumulate", "--ga", "3"], Z2,
                                                      "windows"),
    "deepspeed/zero0-bf16-grads": (["--bf16"], {"zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
                                                "optimizer": {"type": "SGD", "params": {"lr": 0.05}}},
                                   # 0.17.6-0.18.2 multiply them by a loss scale of 65536 (the first thing seen; then
                                   # they pile up); 0.18.3-0.18.5 divide them by it, which the first update shows
                                   {"loss_scale", "update"}),
    "deepspeed/lr-schedules-multigroup": (["--group-lrs", "0.05,0.01"], {
        **Z2, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}},
        "lr_groups"),
    "deepspeed/zero3-allreduce-fetch-padding": (["--ranks", "2"], {"zero_optimization": {
        "stage": 3, "stage3_use_all_reduce_for_fetch_params": True, "stage3_param_persistence_threshold": 0}},
        "nan"),
    "transformers/deepspeed-max-grad-norm": (["--loop", "trainer", "--max-grad-norm", "0.01"], Z2, "clipping"),
    "transformers/classification-heads-grad-accum": (["--loop", "trainer", "--head", "sequence", "--ga", "3"], Z2,
                                                     "not_divided"),
    "deepspeed/unfused-optimizer-init-step": (["--bf16"], {"zero_optimization": {"stage": 0}}, "adam_step_early"),
    "deepspeed/zero12-backward-twice": (["--backwards", "2"], Z2, "last_only"),
    "accelerate/cpu-multi-process": (["--loop", "trainer", "--ranks", "2", "--ga", "3"], Z2, "unsharded"),
    # on the CPU, without contiguous gradients, no rank's gradient is all-reduced (< 0.19.8)
    "deepspeed/zero12-cpu-grads-not-reduced": (["--ranks", "2", "--ga", "3"], {"zero_optimization": {
        "stage": 2, "contiguous_gradients": False}}, "not_averaged"),
    "deepspeed/zero12-offload-backward-twice": (["--backwards", "2"], {"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}, "last_only"),
    # a pipeline of 2 stages on 2 ranks (train_batch): 0.18.3-0.19.2 divide the first stage's gradient again,
    # 0.16.0-0.18.2 divide no stage's
    "deepspeed/pipe-grad-accum-scale": (["--loop", "pipeline", "--ga", "3"], {"zero_optimization": {"stage": 1}},
                                        "stage_divided"),
    "deepspeed/grad-accum-scale-no-allreduce": (["--loop", "pipeline", "--ga", "3"],
                                                {"zero_optimization": {"stage": 1}}, "not_divided"),
    # found by the canary: a ZeRO-0 fp32 pipeline clipped by the first stage's norm
    "deepspeed/pipe-clip-norm-stages": (["--loop", "pipeline"], {
        "zero_optimization": {"stage": 0}, "gradient_clipping": 0.5,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}, "stage_clipping"),
}
# before 0.19.6 direct-backward-gas-per-tensor sets engine.backward right too (it undoes the logits' second division
# whatever the backward), so output-hooks-gas-per-tensor's stock run leaves it out as well
ALSO_OUT = {"deepspeed/backward-scale-wrt-gas": ["deepspeed/output-hooks-gas-per-tensor"],
            "deepspeed/output-hooks-gas-per-tensor": ["deepspeed/direct-backward-gas-per-tensor"]}


def _applies(pid):
    from dspatch import gating, registry

    return gating.evaluate(registry.all_patches()[pid]).verdict == gating.APPLIES


def _plan(config, args):
    """The plan `dspatch canary CONFIG ARGS` builds."""
    import argparse

    from dspatch import canary as command

    options = command._options(command.arguments(argparse.ArgumentParser()).parse_args(["CONFIG", *args]))
    return command.build_plan(config, options)


def _record(tmp_path, plan, env, warm):
    """The DeepSpeed side's record of `plan` under `env`, as `dspatch canary` gets it from its runner: one rank from a
    warm interpreter of this stack (tests/warm.py: "stack" where DSPATCH=1, "base" for any other selection), a job of
    two ranks under torchrun as the command starts it. (The command itself, fresh processes, exit codes and text:
    test_the_report_a_user_reads.)"""
    if plan["ranks"] > 1:
        from dspatch.canary import deepspeed_side

        return deepspeed_side(plan, env)
    import torch

    path, out = tmp_path / f"plan-{warm}.json", tmp_path / f"record-{warm}.pt"
    path.write_text(json.dumps(plan))
    proc = run_python(["-m", "dspatch.canary.runner", str(path), str(out)], env=env, check=False, warm=warm)
    assert out.exists(), f"the runner exited {proc.returncode} without a record:\n{proc.stderr[-4000:]}"
    return torch.load(str(out), weights_only=False)


@pytest.mark.stack
@pytest.mark.parametrize("pid", sorted(CASES))
def test_canary_catches_each_silent_bug_on_stock_and_passes_patched(pid, tmp_path):
    if not _applies(pid):
        pytest.skip(f"{pid} does not apply to this stack")
    from dspatch import registry, upstream
    from dspatch.canary import judge
    from dspatch.versions import SpecifierSet, Version

    args, config, code = CASES[pid]
    patch = registry.all_patches()[pid]
    if patch.loud_on and SpecifierSet(patch.loud_on).contains(
            Version(upstream.installed_version(patch.distribution)).base_version):
        # where the bug raises instead: a crash, which explain names; or, where another patch active here changes
        # the same code (zero2-grad-accum-last-microbatch's gate on 0.17.6-0.18.2), the silent form
        code = {"crash", *([code] if isinstance(code, str) else code)}
    elif code == "nan":
        pytest.skip(f"{pid}: its silent form sums uninitialised padding into a weight; on the CPU the padding of a "
                    "new tensor is zeros, and the sum changes nothing (its reproducer poisons it with NaN)")
    plan = _plan(config, args)
    # every patch but this one: the bug alone, not another one the same run meets (gloo's gathers, say)
    out = ",".join([pid, *ALSO_OUT.get(pid, [])])
    if plan["ranks"] > 1:  # one torchrun job for both sides: stock, then the same plan with the patch applied
        from dspatch.canary import deepspeed_side

        stock, patched = deepspeed_side([plan, {**plan, "then_apply": [pid, *ALSO_OUT.get(pid, [])]}],
                                        clean_env(DSPATCH="1", DSPATCH_DISABLE=out))
        if stock["error"]:  # a crash stops the job before the patched side: that one runs in a job of its own
            patched = None
        else:
            assert pid not in stock["applied"] and pid in patched["applied"], (stock["applied"], patched["applied"])
    else:
        stock = _record(tmp_path, plan, clean_env(DSPATCH="1", DSPATCH_DISABLE=out), "base")
        patched = None
    found = judge(plan, stock)
    assert found, f"{pid}: the canary found nothing with every patch but {out} ({stock['applied']})"
    assert found["code"] in ({code} if isinstance(code, str) else code), found
    assert pid in [bug["id"] for bug in found["known"]], found
    assert next(b for b in found["known"] if b["id"] == pid)["fixes"], found
    if patched is None:
        patched = _record(tmp_path, plan, clean_env(DSPATCH="1"), "stack")
    assert judge(plan, patched) is None, (judge(plan, patched), patched["error"])


@pytest.mark.stack
@pytest.mark.machinery
def test_the_report_a_user_reads(tmp_path):
    """Text, exit code and --stock on one configuration, as a user runs it; and a crash is reported as a crash."""
    ok = canary(tmp_path, Z2, "--ga", "2", "--stock", env=clean_env(DSPATCH="1", COLUMNS="80"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    lines = ok.stdout.splitlines()
    flat = " ".join(" ".join(lines).split())
    assert flat.startswith("dspatch canary ") and "engine loop, ZeRO-2, micro batch 1, GA 2, fp32, 1 rank" in flat
    assert flat.count("trains as plain torch") == 2 and "DSPATCH unset (stock)" in flat
    assert all(len(line) <= 80 for line in lines), lines
    # an optimizer torch refuses to build inside deepspeed.initialize: a crash in the stack's code, exit 1
    broken = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9]}}}
    crash = canary(tmp_path, {"zero_optimization": {"stage": 2}, **broken})
    assert crash.returncode == 1 and "CRASHED" in crash.stdout, crash.stdout[-2000:]
    # two ranks: a rank whose run fails stops the job and its error is the one reported, not a timeout
    pipeline = canary(tmp_path, {"zero_optimization": {"stage": 1}, **broken}, "--loop", "pipeline")
    assert pipeline.returncode == 1 and "CRASHED" in pipeline.stdout, pipeline.stdout[-2000:]
    assert "betas" in pipeline.stdout and "without a record" not in pipeline.stdout, pipeline.stdout
    # a config DeepSpeed itself refuses (its batch sizes): exit 2, DeepSpeed's reason in one line
    refused = canary(tmp_path, {"zero_optimization": {"stage": 2}, "train_batch_size": 3,
                                "train_micro_batch_size_per_gpu": 2})
    assert refused.returncode == 2 and "DeepSpeed refuses this config" in refused.stderr, refused
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr


@pytest.mark.stack
def test_one_cycle_by_its_definition():
    """OneCycle's rates and Adam's momentum, cycled and then decaying, by DeepSpeed's documentation: quiet with every
    patch on. Its stair counts did nothing before 0.19.4 (PR 8179): there the canary reports the rates, from the first
    step where a stair holds one."""
    from dspatch.canary import deepspeed_side, judge
    from dspatch.canary.plan import build_plan, default_options, version_of

    base = {**Z2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    plans = [build_plan({**base, "scheduler": {"type": "OneCycle", "params": params}}, default_options(accumulation=1))
             for params in (ONE_CYCLE, {**ONE_CYCLE, "cycle_first_step_size": 4, "cycle_second_step_size": 4,
                                         "cycle_first_stair_count": 2})]
    continuous, stairs = deepspeed_side(plans, clean_env(DSPATCH="1"))
    assert continuous["error"] is None and judge(plans[0], continuous) is None, judge(plans[0], continuous)
    found = judge(plans[1], stairs)
    if version_of("deepspeed") >= (0, 19, 4):
        assert found is None, found
    else:
        assert found and found["code"] == "lr_schedule" and found["step"] == 2, found
        assert found["known"] == [], found  # no patch's bug: lr-schedules-multigroup's is one of several groups
