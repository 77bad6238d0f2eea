"""Trainer + DeepSpeed: the LR scheduler is built on the optimizer DeepSpeed finalised; 5.1.0's unprepared model fixed.

transformers < 5.1.0 with DeepSpeed and no `scheduler` section in the DeepSpeed config builds the LR scheduler in
`deepspeed_init` (`deepspeed_optim_sched` -> `trainer.create_scheduler(...)`) on the Trainer's optimizer, *before*
`accelerator.prepare(model, optimizer)` runs `deepspeed.initialize`, which removes empty param groups from that
optimizer in place (a LoRA-style job whose bias/norm parameters are all frozen has an empty no-decay group: every
norm/bias weight frozen is enough). The scheduler keeps one entry per original group: on torch >= 2.10 the first
`lr_scheduler.step()` raises `ValueError: zip() argument 2 is longer than argument 1`; on older torch the lists are
truncated, which gives later groups another group's learning rate whenever the removed group is not the last one
(transformers#43692, LoRA + ZeRO-3). Upstream moved the scheduler's creation after `prepare` in 5.1.0 (PR 43711) and
fixed that release's regression in 5.2.0 (PR 43780): 5.1.0 calls `accelerator.prepare` under DeepSpeed only when the
scheduler is a `DummyScheduler`, so a job with a torch scheduler trains its model without DeepSpeed. (Custom accelerate
loops build it too early by another path: accelerate/deepspeed-scheduler-param-groups.)

The fix, backported (the order of 5.2.0), only where DeepSpeed is enabled:
- `deepspeed_optim_sched` no longer builds a torch scheduler on the Trainer's optimizer (that `else` branch is removed:
  `lr_scheduler` stays None); `DummyOptim` / `DummyScheduler` (optimizer or scheduler from the DeepSpeed config) are
  unchanged: DeepSpeed builds those on the optimizer it finalised.
- `Trainer._inner_training_loop`: under DeepSpeed the early `create_optimizer_and_scheduler` is skipped (the optimizer
  exists already: `deepspeed_init` made it), `prepare(model, optimizer)` is called as stock does for a torch scheduler,
  and right after `prepare` the Trainer calls `self.create_scheduler(num_training_steps=max_steps)`, on the prepared
  optimizer, before a checkpoint's scheduler state is loaded into it, so resuming continues the schedule (`scheduler.pt`
  is restored into the new scheduler).
- 5.1.0: only the missing `else: model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)` is added
  under DeepSpeed, as 5.2.0 does.

Without DeepSpeed nothing changes. Tested: each learning rate of every group at every step equals a run without
DeepSpeed. How: both functions are rebuilt from the installed source (`txn.recode`) with those edits (two conditions
extended, one statement inserted, one branch removed); no wrapper, upstream's line numbers kept. The upstream diffs make
the same edits (a test compares the code both give, release by release).

What changes for a subclass: under DeepSpeed `create_optimizer_and_scheduler` is no longer called by the training loop
(upstream stopped calling it in 5.1.0), so a subclass overriding it should override `create_optimizer` /
`create_scheduler` instead; `create_optimizer` (inside `deepspeed_init`) and `create_scheduler` (after prepare, with
`optimizer=None`: the prepared `self.optimizer`) still are called. A checkpoint written by an unpatched run on torch <
2.10 holds a scheduler state with the removed group's entries; resuming from it restores those (as upstream >= 5.1.0
would).

No re-alignment is needed on this path, so it shares nothing with accelerate/deepspeed-scheduler-param-groups (which
re-aligns a scheduler the user built before `Accelerator.prepare`, in dspatch.patches.scheduler_param_groups).
"""
from dspatch.spec import Patch, Signature

PID = "transformers/trainer-scheduler-after-deepspeed"
TRAINER = ("transformers.trainer", "Trainer._inner_training_loop")
OPTIM_SCHED = ("transformers.integrations.deepspeed", "deepspeed_optim_sched")

# every release 4.44.0-5.1.0 (tests/test_releases.py recomputes them)
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

def is_51_form(definition):
    """5.1.0 already builds the scheduler after prepare (no early create_optimizer_and_scheduler call)."""
    from dspatch.rewrite import find_all

    return not find_all(definition, "_.create_optimizer_and_scheduler(...)")


def scheduler_after_prepare(definition):
    """Trainer._inner_training_loop (< 5.1.0): under DeepSpeed, no scheduler before prepare; one right after it."""
    import ast

    from dspatch.rewrite import RewriteError, expression, find_one, matches, statement

    early = find_one(definition, "if not delay_optimizer_creation:\n    _.create_optimizer_and_scheduler(...)")
    early.test = ast.BoolOp(op=ast.And(), values=[early.test, expression("not self.is_deepspeed_enabled", early.test)])
    ast.copy_location(early.test, early.test.values[0])
    branch = find_one(definition, lambda n: isinstance(n, ast.If) and matches(n.test, "hasattr(self.lr_scheduler, 'step')"),
                      "`if hasattr(self.lr_scheduler, \"step\"):`")
    branch.test = ast.BoolOp(op=ast.Or(), values=[branch.test, expression("self.lr_scheduler is None", branch.test)])
    ast.copy_location(branch.test, branch.test.values[0])
    # the statement holding that branch: `if use_accelerator_prepare: ...`, in the function's own body
    body = definition.body
    holder = [i for i, stmt in enumerate(body) if any(node is branch for node in ast.walk(stmt))]
    if len(holder) != 1 or not (isinstance(body[holder[0]], ast.If) and isinstance(body[holder[0]].test, ast.Name)
                                and body[holder[0]].test.id == "use_accelerator_prepare"):
        raise RewriteError(f"{definition.name}: the prepare branch is not under `if use_accelerator_prepare:`")
    at = body[holder[0]]
    body.insert(holder[0] + 1, statement(
        "if self.is_deepspeed_enabled and self.lr_scheduler is None:\n"
        "    self.create_scheduler(num_training_steps=max_steps)", at))


def prepare_model_51(definition):
    """Trainer._inner_training_loop (5.1.0): under DeepSpeed without a DummyScheduler, prepare(model, optimizer)."""
    import ast

    from dspatch.rewrite import RewriteError, copy_tree, find_one, matches

    def checks_type(node):
        return isinstance(node, ast.If) and matches(node.test, "isinstance(...)")

    outer = find_one(definition, lambda n: isinstance(n, ast.If) and matches(n.test, "self.is_deepspeed_enabled")
                     and any(checks_type(s) for s in n.body),
                     "`if self.is_deepspeed_enabled:` around the DummyScheduler prepare")
    inner = next(s for s in outer.body if checks_type(s))
    plain = outer.orelse
    if inner.orelse or len(plain) != 1 or not matches(plain[0], "_ = _.prepare(...)"):
        raise RewriteError(f"{definition.name}: not 5.1.0's DeepSpeed prepare branch")
    inner.orelse = [copy_tree(plain[0])]


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

    from dspatch.rewrite import find_one, matches

    branch = find_one(definition, lambda n: isinstance(n, ast.If) and len(n.orelse) == 1
                      and matches(n.orelse[0], "lr_scheduler = trainer.create_scheduler(...)"),
                      "`else: lr_scheduler = trainer.create_scheduler(...)`")
    branch.orelse = []


def builds_scheduler_before_prepare(definition):
    from dspatch.rewrite import find_all

    return bool(find_all(definition, "_ = trainer.create_scheduler(...)"))


def apply(txn):
    from dspatch import upstream
    import sys

    trainer, optim_sched = txn.target(TRAINER[1]), txn.target(OPTIM_SCHED[1])
    path = sys.modules[OPTIM_SCHED[0]].__file__
    node = upstream.own_definition(path, OPTIM_SCHED[1]) or upstream.definition(path, OPTIM_SCHED[1])
    if builds_scheduler_before_prepare(node):  # < 5.1.0 (5.1.0's builds none: left as it is)
        txn.recode(optim_sched, no_scheduler_on_the_raw_optimizer)
    txn.recode(trainer, transform_trainer)


PATCH = Patch(
    id=PID,
    summary=("Trainer + DeepSpeed: the LR scheduler is built from the optimizer DeepSpeed finalised (empty param "
             "groups removed), as upstream since 5.1.0; 5.1.0's unprepared model fixed as in 5.2.0"),
    cause="The Trainer builds its LR scheduler before DeepSpeed finalises the optimizer's param groups",
    symptom="`ValueError: zip() argument 2 is longer than argument 1` in `lr_scheduler.step()`",
    distribution="transformers",
    affected="<5.2.0",
    fixed_in="5.2.0",
    targets={key: FINGERPRINTS[key] for key in (TRAINER, OPTIM_SCHED)},
    apply=apply,
    supported=">=4.44.0",
    links=("https://github.com/huggingface/transformers/pull/43692",
           "https://github.com/huggingface/transformers/pull/43711",
           "https://github.com/huggingface/transformers/pull/43780"),
    # the backport, one diff per band of releases whose files differ around the change; 5.1.0: PR 43780 only
    diffs=("transformers/0001-trainer-scheduler-after-deepspeed-4.44.0-4.56.2.patch",
           "transformers/0001-trainer-scheduler-after-deepspeed-4.57.1-4.57.6.patch",
           "transformers/0001-trainer-scheduler-after-deepspeed-5.0.0.patch",
           "transformers/0001-trainer-scheduler-after-deepspeed-5.1.0.patch"),
    # a custom accelerate loop gives the same message (accelerate/deepspeed-scheduler-param-groups): frames decide
    signatures=(Signature(r"zip\(\) argument 2 is longer than argument 1", error="ValueError", needs=(r"lr_scheduler",),
                          hints=(r"transformers[/\\]trainer\.py",),
                          tell="the traceback passes through transformers/trainer.py (the Trainer's own loop)"),),
    note=("Trainer._inner_training_loop and deepspeed_optim_sched keep their objects and line numbers but run code "
          "rebuilt from the installed file: under DeepSpeed the scheduler is created right after "
          "accelerator.prepare (create_scheduler is called there; create_optimizer_and_scheduler is not called "
          "under DeepSpeed, as upstream since 5.1.0). On 5.1.0 only the missing prepare(model, optimizer) is added"),
)
