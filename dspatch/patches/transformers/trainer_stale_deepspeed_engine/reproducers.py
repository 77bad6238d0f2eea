"""Reproducers: a real Trainer under DeepSpeed (CPU, 1 rank, fp32), a tiny Llama, 16 causal-LM rows, batches of 4,
two epochs (8 steps), the DeepSpeed config users write (AdamW and WarmupDecayLR with every value "auto").

What is compared, bit for bit, with a fresh Trainer's single `train()` from the same weights: the loss and the
learning rate logged at every step, the weights after training, and the optimizer and scheduler classes the
engine runs. Every engine compared is not the first of its process (deepspeed <= 0.16 trains the first one slightly
differently): `warm()` builds a throw-away one first.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.patches.transformers.trainer_stale_deepspeed_engine import NONE_BACKWARD, ZERO_STEPS
from dspatch.spec import BugSeen, Proof

AUTO = "auto"


def config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    return {"train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO, "gradient_clipping": AUTO,
            "steps_per_print": 10**6, "bf16": {"enabled": AUTO}, "fp16": {"enabled": AUTO}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO,
                                                       "torch_adam": True}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                              "warmup_num_steps": AUTO, "total_num_steps": AUTO}}}


_warm: list = []


def warm():
    """One throw-away engine, so that no engine compared below is the first of this process."""
    if not _warm:
        import torch

        from dspatch.scenario import init_deepspeed

        model = torch.nn.Linear(2, 2)
        _warm.append(init_deepspeed().initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0])


def trainer(stage, weights=None, legacy=False):
    """A Trainer at ZeRO `stage` on a tiny Llama (its weights from `weights` when given); no DeepSpeed at stage
    None; `legacy`: the legacy prediction loop, where the release has one (up to 4.57)."""
    import dataclasses

    import tempfile

    from transformers import Trainer, TrainingArguments

    from dspatch.scenario import lm_rows, reset_accelerate, tiny_llama

    warm()
    reset_accelerate()
    model = tiny_llama()
    if weights is not None:
        model.load_state_dict(weights)
    extra = {"use_legacy_prediction_loop": True} if legacy and "use_legacy_prediction_loop" in {
        f.name for f in dataclasses.fields(TrainingArguments)} else {}
    args = TrainingArguments(**extra, output_dir=tempfile.mkdtemp(prefix="dspatch-stale-"), per_device_train_batch_size=4,
                             per_device_eval_batch_size=8, num_train_epochs=2, learning_rate=1e-2, warmup_steps=2,
                             logging_steps=1, save_strategy="no", report_to=[], bf16=False,
                             deepspeed=None if stage is None else config(stage),
                             seed=42, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=lm_rows(16, 12, seed=3), eval_dataset=lm_rows(8, 12, seed=4))


def train(trainer, stage):
    """trainer.train(); returns what a run is compared on: the log of its steps (loss and learning rate), its
    weights, the optimizer and scheduler classes. Its own stock failures are BugSeen."""
    from dspatch.scenario import gathered_whole

    try:
        trainer.train()
    except AttributeError as e:
        if NONE_BACKWARD not in str(e):
            raise
        raise BugSeen(f"ZeRO-{stage}: the training after an earlier engine: AttributeError: {e}") from e
    except ValueError as e:
        if ZERO_STEPS not in str(e):
            raise
        raise BugSeen(f"ZeRO-{stage}: the training after an earlier engine: ValueError: {ZERO_STEPS} "
                      f"(calculated)") from e
    # train() starts a new TrainerState: its log holds this training's steps only
    steps = [(entry["loss"], entry["learning_rate"]) for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return {"steps": steps, "weights": gathered_whole(trainer.model.named_parameters()),
            "optimizer": type(inner).__name__, "scheduler": type(engine.lr_scheduler).__name__}


def _same(got, want, what):
    import torch

    for key in ("steps", "optimizer", "scheduler"):
        if got[key] != want[key]:
            raise AssertionError(f"{what}: {key} {got[key]} != {want[key]} (one train() alone)")
    changed = [name for name, tensor in want["weights"].items() if not torch.equal(got["weights"][name], tensor)]
    if changed:
        raise AssertionError(f"{what}: weights differ from one train() alone: {changed[:3]}")


_alone: dict = {}


def one_train_alone(stage):
    """A fresh Trainer's single train() at `stage` from the default weights: what both ZeRO-3 scenarios compare
    with, trained once per process (the same numbers each time: its engine is not the process's first)."""
    if stage not in _alone:
        _alone[stage] = train(trainer(stage), stage)
    return _alone[stage]


def evaluate_then_train_zero3():
    """ZeRO-3, trainer.evaluate() then trainer.train(): the evaluation's metrics are those of the same Trainer without
    DeepSpeed, and the training equals one train() alone: losses, learning rates, weights, optimizer, scheduler."""
    # first, before any TrainingArguments with DeepSpeed sets ACCELERATE_USE_DEEPSPEED for this process
    plain = trainer(None).evaluate()["eval_loss"]
    want = one_train_alone(3)
    subject = trainer(3)
    loss = subject.evaluate()["eval_loss"]
    if abs(loss - plain) > 1e-6 * abs(plain):  # the same weights, gathered, in the same forward
        raise AssertionError(f"evaluate() before training under ZeRO-3: eval_loss {loss} != {plain} without DeepSpeed")
    _same(train(subject, 3), want, "ZeRO-3 evaluate() then train()")


def predict_then_train_zero3():
    """ZeRO-3, trainer.predict() (through the legacy prediction loop where the release has one) then
    trainer.train(): the training equals one train() alone."""
    from dspatch.scenario import lm_rows

    want = one_train_alone(3)
    subject = trainer(3, legacy=True)
    # no labels: 4.44-4.46's legacy loop fails on its own computing a loss (`loss.repeat(None)` under accelerate)
    subject.predict([{"input_ids": row["input_ids"]} for row in lm_rows(8, 12, seed=4)])
    _same(train(subject, 3), want, "ZeRO-3 predict() then train()")


def _train_twice(stage):
    subject = trainer(stage)
    first = train(subject, stage)
    second = train(subject, stage)  # before another Trainer resets accelerate's process-wide state
    _same(second, train(trainer(stage, weights=first["weights"]), stage), f"ZeRO-{stage} second train()")


def train_twice_zero2():
    """ZeRO-2, trainer.train() twice: the second equals one train() alone from the weights the first left."""
    _train_twice(2)


def train_twice_zero3():
    """ZeRO-3, trainer.train() twice: the second equals one train() alone from the weights the first left."""
    _train_twice(3)


PROOF = Proof(
    scenarios={"evaluate_then_train_zero3": evaluate_then_train_zero3, "predict_then_train_zero3": predict_then_train_zero3,
               "train_twice_zero2": train_twice_zero2, "train_twice_zero3": train_twice_zero3},
    expected_on_stock={
      "evaluate_then_train_zero3": "ZeRO-3: the training after an earlier engine: ValueError: " + ZERO_STEPS,
      "predict_then_train_zero3": "ZeRO-3: the training after an earlier engine: ValueError: " + ZERO_STEPS,
      "train_twice_zero2": "ZeRO-2: the training after an earlier engine: AttributeError: " + NONE_BACKWARD,
      "train_twice_zero3": "ZeRO-3: the training after an earlier engine: AttributeError: " + NONE_BACKWARD,
  },
    # The releases of transformers that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("4.44.0", "5.24.0"),
)
