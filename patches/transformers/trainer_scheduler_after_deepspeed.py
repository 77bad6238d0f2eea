"""The Trainer builds its LR scheduler from the optimizer DeepSpeed finalised (transformers < 5.1.0), and 5.1.0
prepares the model with DeepSpeed again (5.1.0 only).

transformers < 5.1.0 with DeepSpeed and no `scheduler` section in the DeepSpeed config builds the LR scheduler
in `deepspeed_init` (`deepspeed_optim_sched` -> `trainer.create_scheduler(...)`) on the Trainer's optimizer,
*before* `accelerator.prepare(model, optimizer)` runs `deepspeed.initialize`, which removes empty param groups
from that optimizer in place (a LoRA-style job whose bias/norm parameters are all frozen has an empty no-decay
group). The scheduler keeps one entry per original group: on torch >= 2.10 the first `lr_scheduler.step()`
raises `ValueError: zip() argument 2 is longer than argument 1`; on older torch the lists are truncated, which
gives later groups another group's learning rate whenever the removed group is not the last one
(transformers#43692, LoRA + ZeRO-3). Upstream moved the scheduler's creation after `prepare` in 5.1.0 (PR 43711)
and fixed that release's regression in 5.2.0 (PR 43780): 5.1.0 calls `accelerator.prepare` under DeepSpeed only
when the scheduler is a `DummyScheduler`, so a job with a torch scheduler trains its model without DeepSpeed.

The fix, backported (the order of 5.2.0), only where DeepSpeed is enabled:
- `deepspeed_optim_sched` no longer builds a torch scheduler on the Trainer's optimizer (that `else` branch is
  removed: `lr_scheduler` stays None); `DummyOptim` / `DummyScheduler` (optimizer or scheduler from the
  DeepSpeed config) are unchanged: DeepSpeed builds those on the optimizer it finalised.
- `Trainer._inner_training_loop`: under DeepSpeed the early `create_optimizer_and_scheduler` is skipped (the
  optimizer exists already: `deepspeed_init` made it), `prepare(model, optimizer)` is called as stock does for a
  torch scheduler, and right after `prepare` the Trainer calls `self.create_scheduler(num_training_steps=
  max_steps)`, on the prepared optimizer, before a checkpoint's scheduler state is loaded into it (resuming
  works as before: `scheduler.pt` is restored into the new scheduler).
- 5.1.0: only the missing `else: model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)`
  is added under DeepSpeed, as 5.2.0 does.
Without DeepSpeed nothing changes. How: both functions are rebuilt from the installed source (`txn.recode`)
with those edits (two conditions extended, one statement inserted, one branch removed); no wrapper, upstream's
line numbers kept. The upstream diffs make the same edits (a test compares the code both give, release by release).

What changes for a subclass: under DeepSpeed `create_optimizer_and_scheduler` is no longer called by the training
loop (upstream stopped calling it in 5.1.0); `create_optimizer` (inside `deepspeed_init`) and `create_scheduler`
(after prepare, with `optimizer=None`: the prepared `self.optimizer`) still are. A checkpoint written by an
unpatched run on torch < 2.10 holds a scheduler state with the removed group's entries; resuming from it restores
those (as upstream >= 5.1.0 would).

No re-alignment is needed on this path, so it shares nothing with accelerate/deepspeed-scheduler-param-groups
(which re-aligns a scheduler the user built before `Accelerator.prepare`, in dspatch.patches.scheduler_param_groups).
"""
from dspatch.spec import BugSeen, Patch, Target

PID = "transformers/trainer-scheduler-after-deepspeed"
TRAINER = ("transformers.trainer", "Trainer._inner_training_loop")
OPTIM_SCHED = ("transformers.integrations.deepspeed", "deepspeed_optim_sched")

# every release 4.44.0-5.1.0 (tests/test_gating_trainer_scheduler_after_deepspeed.py recomputes them)
FINGERPRINTS = {
    TRAINER: {"419064e85a84cdd2": "4.44.0-4.44.2", "f58cf18206848c07": "4.45.0-4.45.2", "973a19a66e71580d": "4.46.1",
              "517c903a761dd787": "4.46.2", "cabc488f69e433bb": "4.46.3", "7eb039186784bc2e": "4.47.0",
              "347f4c6c2dfefe20": "4.47.1-4.48.3", "09ee6adf0b594ab6": "4.49.0", "2a245920868e5036": "4.50.0-4.50.3",
              "bcca06c813a74b28": "4.51.0-4.51.3", "7ae46c3373085748": "4.52.1-4.52.4", "e85ca5f963c2394c": "4.53.0",
              "e5fe2d47a7ba78d2": "4.53.1-4.53.3", "1535aaddc82d8918": "4.54.0-4.54.1",
              "1bd100af9bbdbb3f": "4.55.0-4.56.2", "0f0445ff11bcfa8b": "4.57.1-4.57.6", "fe515e645af0dfc0": "5.0.0",
              "4efee8bbf78575ff": "5.1.0"},
    OPTIM_SCHED: {"1562528105546383": "4.44.0-4.56.2", "830f2ca2c63534ec": "4.57.1-4.57.6",
                  "5d0b6134408cef4b": "5.0.0", "b30c31db9802bdbc": "5.1.0"},
}

ZIP = "zip() argument 2 is longer than argument 1"


# ----------------------------------------------------------------------------------------------------
# The transforms (on the AST of the installed source; tests run them on every release's source)

def _is_self_attr(node, attr):
    import ast

    return isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _is_call(node, name=None, method=None):
    import ast

    if not isinstance(node, ast.Call):
        return False
    if name is not None:
        return isinstance(node.func, ast.Name) and node.func.id == name
    return isinstance(node.func, ast.Attribute) and node.func.attr == method


def _expr(text, where):
    """An expression parsed from `text`, every node placed at `where` (tracebacks show upstream's line)."""
    import ast

    node = ast.parse(text, mode="eval").body
    for sub in ast.walk(node):
        if "lineno" in sub._attributes:
            ast.copy_location(sub, where)
    return node


def _statement(text, where):
    import ast

    node = ast.parse(text).body[0]
    for sub in ast.walk(node):
        if "lineno" in sub._attributes:
            ast.copy_location(sub, where)
    return node


def _find(root, predicate, what):
    import ast

    from dspatch.rewrite import RewriteError

    found = [node for node in ast.walk(root) if predicate(node)]
    if len(found) != 1:
        raise RewriteError(f"{root.name}: expected exactly one {what}, found {len(found)}")
    return found[0]


def is_51_form(definition):
    """5.1.0 already builds the scheduler after prepare (no early create_optimizer_and_scheduler call)."""
    import ast

    return not any(_is_call(node, method="create_optimizer_and_scheduler") for node in ast.walk(definition))


def scheduler_after_prepare(definition):
    """Trainer._inner_training_loop (< 5.1.0): under DeepSpeed, no scheduler before prepare; one right after it."""
    import ast

    from dspatch.rewrite import RewriteError

    early = _find(definition, lambda n: isinstance(n, ast.If) and isinstance(n.test, ast.UnaryOp)
                  and isinstance(n.test.op, ast.Not) and isinstance(n.test.operand, ast.Name)
                  and n.test.operand.id == "delay_optimizer_creation" and not n.orelse and len(n.body) == 1
                  and isinstance(n.body[0], ast.Expr)
                  and _is_call(n.body[0].value, method="create_optimizer_and_scheduler"),
                  "`if not delay_optimizer_creation: self.create_optimizer_and_scheduler(...)`")
    early.test = ast.BoolOp(op=ast.And(), values=[early.test, _expr("not self.is_deepspeed_enabled", early.test)])
    ast.copy_location(early.test, early.test.values[0])
    branch = _find(definition, lambda n: isinstance(n, ast.If) and _is_call(n.test, name="hasattr")
                   and len(n.test.args) == 2 and _is_self_attr(n.test.args[0], "lr_scheduler")
                   and isinstance(n.test.args[1], ast.Constant) and n.test.args[1].value == "step",
                   "`if hasattr(self.lr_scheduler, \"step\"):`")
    branch.test = ast.BoolOp(op=ast.Or(), values=[branch.test, _expr("self.lr_scheduler is None", branch.test)])
    ast.copy_location(branch.test, branch.test.values[0])
    # the statement holding that branch: `if use_accelerator_prepare: ...`, in the function's own body
    body = definition.body
    holder = [i for i, stmt in enumerate(body) if any(node is branch for node in ast.walk(stmt))]
    if len(holder) != 1 or not (isinstance(body[holder[0]], ast.If) and isinstance(body[holder[0]].test, ast.Name)
                                and body[holder[0]].test.id == "use_accelerator_prepare"):
        raise RewriteError(f"{definition.name}: the prepare branch is not under `if use_accelerator_prepare:`")
    at = body[holder[0]]
    body.insert(holder[0] + 1, _statement(
        "if self.is_deepspeed_enabled and self.lr_scheduler is None:\n"
        "    self.create_scheduler(num_training_steps=max_steps)", at))


def prepare_model_51(definition):
    """Trainer._inner_training_loop (5.1.0): under DeepSpeed without a DummyScheduler, prepare(model, optimizer)."""
    import ast
    import copy

    from dspatch.rewrite import RewriteError

    outer = _find(definition, lambda n: isinstance(n, ast.If) and _is_self_attr(n.test, "is_deepspeed_enabled")
                  and any(isinstance(s, ast.If) and _is_call(s.test, name="isinstance") for s in n.body),
                  "`if self.is_deepspeed_enabled:` around the DummyScheduler prepare")
    inner = next(s for s in outer.body if isinstance(s, ast.If) and _is_call(s.test, name="isinstance"))
    plain = outer.orelse
    if inner.orelse or len(plain) != 1 or not isinstance(plain[0], ast.Assign) \
            or not _is_call(plain[0].value, method="prepare"):
        raise RewriteError(f"{definition.name}: not 5.1.0's DeepSpeed prepare branch")
    inner.orelse = [copy.deepcopy(plain[0])]


def transform_trainer(definition):
    if is_51_form(definition):
        prepare_model_51(definition)
    else:
        scheduler_after_prepare(definition)


def no_scheduler_on_the_raw_optimizer(definition):
    """deepspeed_optim_sched (< 5.1.0): the branch `else: lr_scheduler = trainer.create_scheduler(...)` is removed,
    so `lr_scheduler` stays None there (the Trainer builds it after prepare); the DummyOptim / DummyScheduler
    branches are unchanged."""
    import ast

    def creates(node):
        return isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
            and node.targets[0].id == "lr_scheduler" and _is_call(node.value, method="create_scheduler") \
            and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "trainer"

    branch = _find(definition, lambda n: isinstance(n, ast.If) and len(n.orelse) == 1 and creates(n.orelse[0]),
                   "`else: lr_scheduler = trainer.create_scheduler(...)`")
    branch.orelse = []


def builds_scheduler_before_prepare(definition):
    import ast

    return any(isinstance(n, ast.Assign) and _is_call(n.value, method="create_scheduler")
               and isinstance(n.value.func.value, ast.Name) and n.value.func.value.id == "trainer"
               for n in ast.walk(definition))


def apply(txn):
    from dspatch import gating
    import sys

    trainer, optim_sched = txn.target(TRAINER[1]), txn.target(OPTIM_SCHED[1])
    node = gating.definition(sys.modules[OPTIM_SCHED[0]].__file__, OPTIM_SCHED[1])
    if builds_scheduler_before_prepare(node):  # < 5.1.0 (5.1.0's builds none: left as it is)
        txn.recode(optim_sched, no_scheduler_on_the_raw_optimizer)
    txn.recode(trainer, transform_trainer)


# ----------------------------------------------------------------------------------------------------
# Reproducers: a real Trainer (tiny Llama from a config, CPU), with DeepSpeed ZeRO-2 (one process), against the
# same Trainer without DeepSpeed: the learning rate of every param group at every step must be equal.

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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    if freeze_norms:  # as LoRA-style fine-tuning: every no-decay parameter (norms; Llama has no biases) frozen
        for name, param in model.named_parameters():
            if "norm" in name:
                param.requires_grad_(False)
    return model


def _data():
    import torch

    generator = torch.Generator().manual_seed(3)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(4, 64, (STEPS * 2, 8),
                                                                       generator=generator).tolist()]


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
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(True)
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
            AcceleratorState._reset_state(True)
        if deepspeed is not None and type(trainer.model_wrapped).__name__ != "DeepSpeedEngine":
            raise BugSeen(f"the model was never prepared with DeepSpeed (trained as "
                          f"{type(trainer.model_wrapped).__name__})")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return recorder.lrs, losses, trainer


_reference = {}


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


PATCH = Patch(
    id=PID,
    summary=("Trainer + DeepSpeed: the LR scheduler is built from the optimizer DeepSpeed finalised (empty param "
             "groups removed), as upstream since 5.1.0; 5.1.0's unprepared model fixed as in 5.2.0"),
    distribution="transformers",
    affected="<5.2.0",
    fixed_in="5.2.0",
    targets=[Target(module, qualname, FINGERPRINTS[(module, qualname)]) for module, qualname in (TRAINER, OPTIM_SCHED)],
    apply=apply,
    supported=">=4.44.0",
    links=("https://github.com/huggingface/transformers/pull/43692",
           "https://github.com/huggingface/transformers/pull/43711",
           "https://github.com/huggingface/transformers/pull/43780"),
    # the backport, one diff per band of releases whose files differ around the change; 5.1.0: PR 43780 only
    diffs={">=4.44.0,<=4.56.2": "transformers/0001-trainer-scheduler-after-deepspeed-4.44.0-4.56.2.patch",
           ">=4.57.1,<=4.57.6": "transformers/0001-trainer-scheduler-after-deepspeed-4.57.1-4.57.6.patch",
           "==5.0.0": "transformers/0001-trainer-scheduler-after-deepspeed-5.0.0.patch",
           "==5.1.0": "transformers/0001-trainer-scheduler-after-deepspeed-5.1.0.patch"},
    scenarios={"frozen_no_decay_group": frozen_no_decay_group,
               "optimizer_or_scheduler_from_ds_config": optimizer_or_scheduler_from_ds_config,
               "resume_from_checkpoint": resume_from_checkpoint},
    expected_on_stock={"frozen_no_decay_group": f"Trainer.train: lr_scheduler.step(): ValueError: {ZIP}",
                       "resume_from_checkpoint": f"Trainer.train: lr_scheduler.step(): ValueError: {ZIP}"},
    signatures=(r"ValueError: zip\(\) argument 2 is longer than argument 1",),
    note=("Trainer._inner_training_loop and deepspeed_optim_sched keep their objects and line numbers but run code "
          "rebuilt from the installed file: under DeepSpeed the scheduler is created right after "
          "accelerator.prepare (create_scheduler is called there; create_optimizer_and_scheduler is not called "
          "under DeepSpeed, as upstream since 5.1.0). On 5.1.0 only the missing prepare(model, optimizer) is added"),
)
