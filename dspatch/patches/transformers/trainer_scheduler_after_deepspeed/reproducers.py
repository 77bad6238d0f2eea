"""Reproducers: a real Trainer (tiny Llama from a config, CPU), with DeepSpeed ZeRO-2 (one process), against the
same Trainer without DeepSpeed: the learning rate of every param group at every step must be equal.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof
from dspatch.patches.transformers.trainer_scheduler_after_deepspeed import ZIP


STEPS = 6
WARMUP = 4


class _Recorder:
    """A TrainerCallback (built lazily: transformers is imported inside the scenarios) recording, at the start of
    every step, the learning rate of every non-empty param group."""

    @staticmethod
    def make():
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            def __init__(self):
                self.lrs = {}

            def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
                self.lrs[state.global_step] = [g["lr"] for g in optimizer.param_groups if len(g["params"])]

        return Recorder()


def _model(freeze_norms):
    from dspatch.scenario import tiny_llama

    model = tiny_llama()
    if freeze_norms:  # as LoRA-style fine-tuning: every no-decay parameter (norms; Llama has no biases) frozen
        for name, param in model.named_parameters():
            if "norm" in name:
                param.requires_grad_(False)
    return model


def _data():
    from dspatch.scenario import lm_rows

    return lm_rows(STEPS * 2, 8)


def ds_config(optimizer=False, scheduler=False):
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "steps_per_print": 10**6, "zero_optimization": {"stage": 2}}
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
    if scheduler:
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto", "warmup_type": "linear"}}
    return config


def _loads_past_other_bug():
    """deepspeed <= 0.15.4 (and transformers' own rng-state load in old releases) cannot torch.load their
    checkpoints with torch >= 2.6 (weights_only default): torch's own escape hatch, always (transformers' load is
    not dspatch's to fix), so that the resume reproducer shows this bug and nothing else on every stack."""
    from dspatch.scenario import loads_past_weights_only_bug

    return loads_past_weights_only_bug(unless_applied=None)


def run_trainer(deepspeed=None, freeze_norms=True, out=None, save_steps=None, resume=None):
    """{step: [lr of each non-empty group]}, [losses], the Trainer."""
    import tempfile

    from dspatch.scenario import init_deepspeed

    init_deepspeed()
    from dspatch.scenario import reset_accelerate
    from transformers import Trainer, TrainingArguments

    reset_accelerate()
    with tempfile.TemporaryDirectory() as tmp:
        save = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}
        # use_cpu only without DeepSpeed: transformers 4.44 lets it switch DeepSpeed off (DS_ACCELERATOR=cpu
        # puts DeepSpeed on the CPU)
        args = TrainingArguments(output_dir=out or tmp, per_device_train_batch_size=2, max_steps=STEPS,
                                 learning_rate=1e-2, warmup_steps=WARMUP, lr_scheduler_type="linear",
                                 weight_decay=0.1, logging_steps=1, report_to=[], deepspeed=deepspeed,
                                 use_cpu=deepspeed is None, dataloader_num_workers=0, seed=0, data_seed=0, **save)
        recorder = _Recorder.make()
        trainer = Trainer(model=_model(freeze_norms), args=args, train_dataset=_data(), callbacks=[recorder])
        try:
            with _loads_past_other_bug():
                trainer.train(resume_from_checkpoint=resume)
        except ValueError as e:
            if ZIP not in str(e):
                raise
            raise BugSeen(f"Trainer.train: lr_scheduler.step(): ValueError: {e}") from e
        finally:
            reset_accelerate()
        if deepspeed is not None and type(trainer.model_wrapped).__name__ != "DeepSpeedEngine":
            raise BugSeen(f"the model was never prepared with DeepSpeed (trained as "
                          f"{type(trainer.model_wrapped).__name__})")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return recorder.lrs, losses, trainer


_reference: dict = {}


def reference(freeze_norms=True):
    """The same Trainer without DeepSpeed (computed once per process)."""
    if freeze_norms not in _reference:
        _reference[freeze_norms] = run_trainer(None, freeze_norms)[0]
    return _reference[freeze_norms]


def _same_lrs(got, want, what, close=False):
    import math

    if set(got) != set(want):
        raise AssertionError(f"{what}: steps {sorted(got)} recorded, {sorted(want)} expected")
    for step in sorted(want):
        a, b = got[step], want[step]
        same = a == b if not close else len(a) == len(b) and all(
            math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-15) for x, y in zip(a, b))
        if not same:
            raise BugSeen(f"{what}: learning rates at step {step} differ from the Trainer without DeepSpeed: "
                          f"{a} != {b}")


def frozen_no_decay_group():
    """DeepSpeed config without optimizer/scheduler (the Trainer makes both), every norm weight frozen (the
    no-decay group is empty): every group's learning rate at every step as without DeepSpeed."""
    want = reference()
    got = run_trainer(ds_config())[0]
    _same_lrs(got, want, "ZeRO-2, Trainer's optimizer and scheduler, empty no-decay group")


def optimizer_or_scheduler_from_ds_config():
    """Optimizer and/or scheduler from the DeepSpeed config (DummyOptim / DummyScheduler): DeepSpeed builds them on
    the optimizer it kept. Optimizer from the config, the Trainer's scheduler (built by DeepSpeed through the
    Trainer's callable): every rate as without DeepSpeed. Scheduler from the config (WarmupDecayLR): DeepSpeed's
    own scheduler drives the Trainer's optimizer (its rates, which differ between DeepSpeed releases in the first
    steps, are compared stock against patched by the tests)."""
    want = reference()
    # DeepSpeed's own optimizer takes all trainable parameters as one group
    got = run_trainer(ds_config(optimizer=True))[0]
    _same_lrs(got, {step: lrs[:1] for step, lrs in want.items()}, "optimizer from the DeepSpeed config")
    lrs, _, trainer = run_trainer(ds_config(scheduler=True))
    inner = getattr(trainer.lr_scheduler, "scheduler", None)
    if type(inner).__name__ != "WarmupDecayLR" or sorted(lrs) != sorted(want):
        raise AssertionError(f"scheduler from the DeepSpeed config: {type(trainer.lr_scheduler).__name__} around "
                             f"{type(inner).__name__}, steps {sorted(lrs)}")
    groups = trainer.model_wrapped.optimizer.param_groups
    if [g["lr"] for g in groups] != [g["lr"] for g in inner.optimizer.param_groups]:
        raise AssertionError("DeepSpeed's scheduler does not drive the optimizer DeepSpeed kept")


def resume_from_checkpoint():
    """Train with a checkpoint at step 3 (inside the warm-up), resume a new Trainer from it: the scheduler's state
    comes back and the schedule continues as in the uninterrupted run and without DeepSpeed."""
    import os
    import tempfile

    want = reference()
    with tempfile.TemporaryDirectory() as out:
        first = run_trainer(ds_config(), out=out, save_steps=3)[0]
        _same_lrs(first, want, "ZeRO-2 before the checkpoint")
        resumed = run_trainer(ds_config(), out=out, resume=os.path.join(out, "checkpoint-3"))[0]
    _same_lrs(resumed, {step: lrs for step, lrs in want.items() if step >= 3}, "ZeRO-2 resumed from step 3")


PROOF = Proof(
    scenarios={"frozen_no_decay_group": frozen_no_decay_group,
               "optimizer_or_scheduler_from_ds_config": optimizer_or_scheduler_from_ds_config,
               "resume_from_checkpoint": resume_from_checkpoint},
    expected_on_stock={"frozen_no_decay_group": f"Trainer.train: lr_scheduler.step(): ValueError: {ZIP}",
                       "resume_from_checkpoint": f"Trainer.train: lr_scheduler.step(): ValueError: {ZIP}"},
    # The releases of transformers that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("4.44.0", "5.1.0"),
)
