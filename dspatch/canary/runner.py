"""The DeepSpeed side of a canary run, in an interpreter of its own (dspatch as the environment has it there):

    python -m dspatch.canary.runner PLAN.json OUT.pt

trains the plan's model through DeepSpeed on the plan's loop (the raw engine, an accelerate loop, the Trainer, a
pipeline's train_batch) and writes, with torch.save, {"steps": [{"lrs", "gradient", "grad_norm", "weights"} per
optimizer step], "losses": every micro-batch's (a pipeline: every batch's), "error": None or what failed, "applied":
the patches in force, "stages": a pipeline's parameter names per stage}. Each step is recorded where DeepSpeed takes
it (a wrapper on DeepSpeedEngine.step, whichever loop calls it; on PipelineEngine._take_model_step for a pipeline):
the rates and the full gradient just before (DeepSpeed's safe_get_full_grad: ZeRO partitions gathered), the norm it
reports and the fp32 weights after (safe_get_full_fp32_param: bf16's master copy).
"""
import json
import os
import sys
import traceback


def _masters(optimizer):
    """{id(model parameter): its fp32 master} of an optimizer that keeps them in groups beside the model's (stage 0's
    FP16_UnfusedOptimizer and FP16_Optimizer, bf16 or fp16), where DeepSpeed's accessors have no mapping."""
    found = {}
    for low, high in zip(getattr(optimizer, "fp16_groups", ()) or (), getattr(optimizer, "fp32_groups", ()) or ()):
        for p, master in zip(low, high):
            found[id(p)] = master
    return found


def _full(engine, what):
    """{name: fp32 tensor} of every trainable parameter's full `what` ("weight": the fp32 value the optimizer holds;
    "grad": the gradient it is about to apply), through DeepSpeed's own accessors (ZeRO partitions gathered)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    masters = _masters(engine.optimizer) if what == "weight" else {}
    found = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        try:
            mapped = getattr(p, "_hp_mapping", None) is not None  # BF16_Optimizer and ZeRO-1/2: the fp32 copy's own
            if what == "grad":
                value = p.get_full_hp_grad() if mapped and hasattr(p, "get_full_hp_grad") else safe_get_full_grad(p)
            else:
                value = safe_get_full_fp32_param(p)
        except Exception:  # no mapping kept on this path: the optimizer's master, or the parameter's own
            value = None
        if value is None:
            value = (p.grad if what == "grad" else masters.get(id(p), p))
        found[name] = None if value is None else value.detach().to(torch.float32).cpu().clone()
    return found


def _loss_scale(optimizer):
    """The loss scale the optimizer's scaler holds for the step about to be taken (1 outside fp16), or None."""
    for owner, name in ((getattr(optimizer, "loss_scaler", None), "cur_scale"), (optimizer, "cur_scale"),
                        (optimizer, "loss_scale")):
        value = getattr(owner, name, None) if owner is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def allow_fp16_on_the_cpu():
    """The canary's process only (never the user's job): the CPU accelerator says it supports fp16, so that DeepSpeed
    builds an fp16 engine there (releases before 0.18 answer no; later ones ask oneDNN). The engine's own code is
    unchanged: its loss scaler, its overflow checks, its fp16 copies."""
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]


RECORDING: list = []  # the record the instrumented step writes to (the run in progress)
UNMODELLED = "not modelled: "  # an error that says the run cannot be what the plan means (exit 2, not a crash)


def instrument(record):
    """Record each optimizer step DeepSpeed takes, whatever loop drives it: at a boundary, before the step, the rates
    and the gradient it applies; after it, the reported gradient norm and the weights (into `record`, the run in
    progress; the wrapper is installed once per process)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    RECORDING[:] = [record]
    _record_steps_of(DeepSpeedEngine, "step")


def _record_steps_of(cls, name):
    """Wrap `cls.name`, a method that takes the optimizer step at a boundary, to record each step it takes (once)."""
    original = getattr(cls, name)
    if getattr(original, "dspatch_canary", False):
        return

    def step(self, *args, **kwargs):
        boundary = self.is_gradient_accumulation_boundary()
        seen = ([g["lr"] for g in self.optimizer.param_groups], _full(self, "grad"), _loss_scale(self.optimizer)) \
            if boundary else None
        before, skipped = self.global_steps, getattr(self, "skipped_steps", 0)
        result = original(self, *args, **kwargs)
        if seen and self.global_steps > before:
            norm = self.get_global_grad_norm()
            lrs, gradient, scale = seen
            if RECORDING[0].fp16 and scale and scale != 1:  # fp16: still scaled before the step, as the loss was
                # (only in fp16: bf16 at ZeRO-0 on 0.17.6-0.18.2 holds a scale of 65536 it must not have, a bug)
                gradient = {n: None if g is None else g / scale for n, g in gradient.items()}
            RECORDING[0].step(lrs, gradient, norm, _full(self, "weight"), scale=scale,
                              skipped=getattr(self, "skipped_steps", 0) > skipped)
        return result

    step.dspatch_canary = True
    setattr(cls, name, step)


def _engine_loop(plan, model, batches, record):
    import deepspeed

    from dspatch.canary.model import groups, optimizer_of

    params = groups(model, plan["lrs"])
    client = None if plan["config"].get("optimizer") else optimizer_of(plan, params)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client, config=plan["config"])
    per_step, calls = plan["backwards"], 0
    for _ in range(plan["epochs"]):
        for start in range(0, len(batches), per_step):
            if plan.get("early") and calls == plan["early"] * plan["accumulation"]:
                return engine  # the steps compared are taken: DeepSpeed's count, not the record's, decides
            calls += 1
            for k, batch in enumerate(batches[start:start + per_step]):
                if plan["boundary_call"]:  # the step's last backward is its boundary, the others not
                    engine.set_gradient_accumulation_boundary(k == per_step - 1)
                loss = engine(**_on(batch)).loss
                if plan.get("backward") == "torch":  # the PyTorch-style backward (fp16: on the scaled loss)
                    (engine.scale(loss) if plan["precision"] == "fp16" else loss).backward()
                else:
                    engine.backward(loss)
                record.loss(loss)
            engine.step()
    return engine


def _on(batch):
    from dspatch.scenario import on_accelerator

    return {key: on_accelerator(value) for key, value in batch.items()}


def _pipeline_loop(plan, model, batches, record):
    """A PipelineModule of the token model's layers, one stage per rank, trained by train_batch (GA micro-batches of
    one stream per call, as a pipeline user feeds it); each step recorded where PipelineEngine takes it
    (_take_model_step: its step() refuses), then every stage's gradients and weights gathered into every rank's record
    (the reference trains the whole model)."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from dspatch.canary.model import optimizer_of, token_loss
    from dspatch.canary.plan import steps_taken

    _record_steps_of(PipelineEngine, "_take_model_step")
    module = PipelineModule(layers=list(model), num_stages=plan["stages"], loss_fn=token_loss,
                            partition_method="uniform")
    params = [{"params": [p for p in module.parameters() if p.requires_grad], "lr": plan["lrs"][0]}]
    client = None if plan["config"].get("optimizer") else optimizer_of(plan, params)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, optimizer=client, config=plan["config"])
    batches = [_on(batch) for batch in batches]
    stream = iter([(batch["input_ids"], batch["labels"]) for _ in range(plan["epochs"]) for batch in batches])
    for _ in range(plan.get("early") or steps_taken("pipeline", plan["per_epoch"], plan["accumulation"],
                                                   plan["epochs"])):
        record.loss(engine.train_batch(data_iter=stream))
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (names, record.steps))
    record.stages = [stage_names for stage_names, _ in every]
    for number, step in enumerate(record.steps):
        for _, steps in every:
            step["gradient"].update(steps[number]["gradient"])
            step["weights"].update(steps[number]["weights"])
    return engine


def _every_ranks(plan, batches):
    """The dataset a loop that shards its own data (accelerate's prepared loader, the Trainer's) is given on every
    rank: with several ranks, the ranks' micro-batches interleaved (rank 0's first, rank 1's first, rank 0's second...),
    so that the loader's sharding, batch i to rank i mod ranks, hands each rank its own, as the reference takes them."""
    if plan["ranks"] < 2:
        return batches
    from dspatch.canary.model import micro_batches

    each = [micro_batches(plan, rank) for rank in range(plan["ranks"])]
    return [batch for group in zip(*each) for batch in group]


def _accelerate_loop(plan, model, batches, record):
    import contextlib

    import torch

    from dspatch.canary.model import groups, optimizer_of
    from dspatch.scenario import reset_accelerate

    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    reset_accelerate()
    config = plan["config"]
    accelerator = Accelerator(gradient_accumulation_steps=plan["accumulation"],
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    params = groups(model, plan["lrs"])
    optimizer = DummyOptim(params, lr=plan["lrs"][0]) if config.get("optimizer") else optimizer_of(plan, params)
    rows = [{key: value[i] for key, value in batch.items()} for batch in _every_ranks(plan, batches)
            for i in range(len(batch["labels"]))]
    loader = torch.utils.data.DataLoader(rows, batch_size=plan["micro"], shuffle=False)
    if config.get("scheduler"):
        scheduler = DummyScheduler(optimizer, warmup_num_steps=max(1, plan["warmup_steps"]))
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        scheduler = None
    for _ in range(plan["epochs"]):
        for batch in loader:
            with accelerator.accumulate(model) if plan.get("accumulate", True) else contextlib.nullcontext():
                loss = model(**batch).loss
                accelerator.backward(loss)
                if plan.get("clip_call") is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), plan["clip_call"])
                record.loss(loss)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
    reset_accelerate()
    return model


def _trainer_loop(plan, model, batches, record):
    import tempfile

    import torch

    from dspatch.scenario import reset_accelerate

    from transformers import Trainer, TrainingArguments

    class InOrder(Trainer):  # the reference takes the rows in order: so does this Trainer
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    rows = [{key: value[i].tolist() for key, value in batch.items()} for batch in _every_ranks(plan, batches)
            for i in range(len(batch["labels"]))]
    reset_accelerate()
    with tempfile.TemporaryDirectory() as out:
        given = plan["trainer_args"]  # the config's explicit values and the options, as build_plan made them
        args = TrainingArguments(output_dir=out, **given,
                                 optim="adamw_torch", logging_steps=1, save_strategy="no",
                                 report_to=[], deepspeed=plan["trainer_config"],
                                 # TrainingArguments refuses bf16 on the CPU unless told it is the CPU
                                 use_cpu=plan["precision"] == "bf16" and plan["device"] == "cpu",
                                 dataloader_num_workers=0, seed=0, data_seed=0, remove_unused_columns=False)
        trainer = InOrder(model=model, args=args, train_dataset=rows)
        trainer.train()
        if not record.steps:  # no DeepSpeedEngine stepped: the Trainer ran without it
            raise RuntimeError(f"{UNMODELLED}the Trainer of this transformers trains without DeepSpeed here (bf16 on "
                               "the CPU needs use_cpu, which it reads as no DeepSpeed)")
    norms = [entry.get("grad_norm") for entry in trainer.state.log_history if "loss" in entry]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    record.logged(norms, losses)
    reset_accelerate()
    return trainer


class Record:
    def __init__(self, fp16=False):
        self.steps, self.losses, self.error = [], [], None
        self.fp16 = fp16  # the gradients DeepSpeed holds before a step are scaled by the loss scale
        self.stages = None  # a pipeline's: the parameter names of each stage

    def loss(self, loss):
        self.losses.append(loss.item())

    def step(self, lrs, gradient, grad_norm, weights, scale=None, skipped=False):
        self.steps.append({"lrs": lrs, "gradient": gradient,
                           "grad_norm": None if grad_norm is None else float(grad_norm), "weights": weights,
                           "scale": scale, "skipped": skipped})

    def as_dict(self, applied):
        """What `dspatch canary` reads of a run: its steps, losses, error, and the patches in force (`applied`)."""
        return {"steps": self.steps, "losses": self.losses, "error": self.error, "applied": applied,
                "stages": self.stages}

    def logged(self, norms, losses):
        for step, norm, loss in zip(self.steps, norms, losses):
            step["logged_grad_norm"] = None if norm is None else float(norm)
            step["logged_loss"] = float(loss)


LOOPS = {"engine": _engine_loop, "accelerate": _accelerate_loop, "trainer": _trainer_loop, "pipeline": _pipeline_loop}


def accepted(config, data_ranks):
    """None where DeepSpeed's own config classes accept `config` (its batch sizes for `data_ranks` data-parallel
    ranks, as its engine counts them), else why not, in one line: what DeepSpeed itself refuses is not the canary's
    to train."""
    import contextlib
    import io
    import types

    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its INFO lines are not the canary's output
            DeepSpeedConfig(json.loads(json.dumps(config)),
                            mpu=types.SimpleNamespace(get_data_parallel_world_size=lambda: data_ranks))
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        return " ".join(lines[:3])
    return None


# functions that check a config as they fill it (accelerate's and transformers' fill_match, accelerate's
# deepspeed_config_process): a ValueError raised there is a refusal of the config, not a crash in training
CONFIG_CHECKS = {"fill_match": "accelerate", "deepspeed_config_process": "accelerate",
                 "trainer_config_finalize": "the Trainer"}


def _in_the_canary(trace):
    """Where an exception was raised in the canary's own code (not DeepSpeed's, transformers', accelerate's or
    torch's, which the canary calls): the function's name, else None."""
    own = os.path.dirname(os.path.abspath(__file__))
    last = trace[-1] if trace else None
    return last.name if last and os.path.dirname(os.path.abspath(last.filename)) == own else None


def run(plan):
    """The record of one run of `plan` in this process."""
    from dspatch.canary.model import build, micro_batches
    from dspatch.scenario import init_deepspeed

    import torch

    record = Record(fp16=plan["precision"] == "fp16")
    try:
        init_deepspeed()
        if plan["precision"] == "fp16":
            allow_fp16_on_the_cpu()
        why = accepted(plan["config"], plan["data_ranks"])
        if why:
            raise RuntimeError(f"{UNMODELLED}DeepSpeed refuses this config: {why}")
        instrument(record)
        rank = 0 if plan["loop"] == "pipeline" else torch.distributed.get_rank()  # a pipeline's stages share its data
        LOOPS[plan["loop"]](plan, build(plan), micro_batches(plan, rank), record)
    except Exception as e:  # a run that crashes is reported as such, with the error, not as a divergence
        trace = traceback.extract_tb(e.__traceback__)
        where = _in_the_canary(trace)
        if trace and trace[-1].name in CONFIG_CHECKS and isinstance(e, ValueError):
            # the loop's library refuses the config as it fills it: what the user's job would be told at its start
            record.error = f"{UNMODELLED}{CONFIG_CHECKS[trace[-1].name]} refuses this config: " + \
                " ".join(str(e).split())
        elif where and UNMODELLED not in str(e):  # the canary's own harness failed: not a bug of the user's stack
            record.error = f"{UNMODELLED}the canary cannot model this: {type(e).__name__}: {e} (in {where})\n" \
                f"{traceback.format_exc()}"
        else:
            record.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return record


def _apply_before(ids):
    """A plan's `then_apply` (the tests' own key: a job of several ranks runs a bug's stock and patched sides in one
    torchrun, the second plan applying the patch the first ran without): those patches applied now, in every rank,
    DSPATCH_DISABLE notwithstanding. None when they are in force; else a record of the failure."""
    import dspatch
    from dspatch import _runtime

    os.environ.pop("DSPATCH_DISABLE", None)  # it names them: the first plan's run left them out
    dspatch.apply(ids)
    missing = [pid for pid in ids if pid not in _runtime.applied_ids()]
    if not missing:
        return None
    record = Record()
    record.error = f"{UNMODELLED}then_apply: {', '.join(missing)} not applied in this run"
    return record


def _stop_the_job(out, error):
    """A rank whose run failed: its peers wait for it in a collective (a pipeline's stages run different code, so one
    may fail alone). Its error goes to OUT.rankN.error for the command to report, and the rank exits at once, which
    makes torchrun (or launch_ranks) stop the others."""
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.rank{rank}.error", "w", encoding="utf-8") as f:
        f.write(error)
    sys.stderr.write(error)
    sys.stderr.flush()
    os._exit(1)


def main(argv):
    """One process: `python -m dspatch.canary.runner PLANS OUT`; the ranks of a job (under torchrun) alike, rank 0
    writing OUT. PLANS holds one plan or a list of them (run in turn in this process: the tests' matrices); OUT gets
    one record or the list."""
    import torch

    from dspatch import _runtime

    with open(argv[0], encoding="utf-8") as f:
        plans = json.load(f)
    records = []
    for one in plans if isinstance(plans, list) else [plans]:
        if one.get("then_apply"):
            record = _apply_before(one["then_apply"]) or run(one)
        else:
            record = run(one)
        if record.error and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            _stop_the_job(argv[1], record.error)
        records.append(record.as_dict(_runtime.applied_ids()))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(records if isinstance(plans, list) else records[0], argv[1])
    from dspatch.scenario import leave_distributed

    leave_distributed()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4:  # a rank of dspatch.ranks.launch_ranks (a reproducer's job): FOLDER PLANS OUT
        main(sys.argv[2:])
        from dspatch.ranks import finish_rank

        finish_rank(sys.argv[1], {})
    sys.exit(main(sys.argv[1:]))
