"""A loader resumed in the middle of epoch k >= 1 keeps epoch k's shuffle, not epoch 0's (accelerate 1.7.0-1.14.x).

`skip_first_batches` builds a new `DataLoaderShard` (or `DataLoaderDispatcher`) over the same sampler, whose
`iteration` starts at 0, and its `__iter__` calls `set_epoch(self.iteration)`. Since 1.7.0 (PR 3556) `set_epoch`
reaches the sampler inside `SkipBatchSampler`, the `SeedableRandomSampler` it shares with the loader it came from: a
loop that sets the epoch and then skips (the Trainer on resume, transformers 4.46-4.57, and any accelerate loop
written that way) has its epoch reset to 0 by the skipped loader. The rest of the epoch is drawn from epoch 0's
order, silently: some rows are trained twice in that epoch, others never. A Trainer of 2 epochs of 4 steps, saved at
step 6 and resumed, trains steps 7-8 on rows [2, 5], [1, 6] instead of [7, 3], [1, 0] (transformers 4.57.6 with
accelerate 1.10.1, 4.46.3 with 1.8.1). transformers 5.x sets the epoch after skipping and is not hit. accelerate
1.15.0 (PR 4071) passes the loader's `iteration` to the one it builds; accelerate 4233, ms-swift 10050 and cosmos-rl
PR 609 tell of it.

The fix is 1.15.0's: `skip_first_batches`, rebuilt from the installed source (`txn.recode`, so that the names
`accelerate`, `accelerate.accelerator` and `transformers.trainer` bound at their import reach the fix too), gives the
loader it builds the `iteration` of the one it was given. A loop that iterates the skipped loader without setting its
epoch first, as 5.x's Trainer does, is not changed: that epoch is the one the loader carries anyway.

Not covered: an `IterableDataset` with its own `set_epoch` (as `datasets`' streaming ones) has its epoch reset by the
same path before 1.7.0 too (1.15.0 fixes that as well); the patch is written for 1.7.0-1.14.0.
"""
from dspatch.spec import Patch

DATA_LOADER = "accelerate.data_loader"
SKIP = "skip_first_batches"
# every release 1.7.0-1.14.0 (python tests/upstream_releases.py accelerate/skip-first-batches-epoch 1.7.0 1.14.0)
FINGERPRINTS = {(DATA_LOADER, SKIP): {"5bc8161191b569a4": "1.7.0-1.14.0"}}
LOADERS = ("DataLoaderShard", "DataLoaderDispatcher")


def keep_iteration(built, source):
    """The loader skip_first_batches built, carrying the iteration (epoch) of the one it was given."""
    iteration = getattr(source, "iteration", None)
    if isinstance(iteration, int):
        built.iteration = iteration
    return built


def iteration_kept(definition):
    """Transform: each `DataLoaderShard(...)` and `DataLoaderDispatcher(...)` built from `dataloader` becomes
    `keep_iteration(<that call>, dataloader)` (`dataloader` is still the loader given: the call is the right-hand side
    of its assignment)."""
    import ast

    from dspatch.rewrite import call_into, expression, find_all, replace

    calls = find_all(definition, lambda node: isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                     and node.func.id in LOADERS)
    if sorted(call.func.id for call in calls) != sorted(LOADERS):
        from dspatch.rewrite import RewriteError

        raise RewriteError(f"{SKIP}: expected one call of each of {', '.join(LOADERS)}")
    for call in calls:
        kept = expression(f"{call_into(__name__, 'keep_iteration')}(_, dataloader)", call)
        kept.args[0] = call
        replace(definition, call, kept)


def apply(txn):
    txn.recode(txn.target(SKIP), iteration_kept)


PATCH = Patch(
    id="accelerate/skip-first-batches-epoch",
    summary=("skip_first_batches gives the loader it builds the epoch of the one it was given: a run resumed inside "
             "epoch k >= 1 keeps epoch k's order"),
    cause=("The loader skip_first_batches builds starts at epoch 0 and resets the sampler it shares with the original "
           "to epoch 0's order"),
    symptom="a run resumed inside epoch k >= 1 silently trains on epoch 0's order: some rows twice, others never",
    distribution="accelerate",
    affected=">=1.7.0,<1.15.0",
    fixed_in="1.15.0",
    supported=">=1.7.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/accelerate/pull/4071", "https://github.com/huggingface/accelerate/pull/3556",
           "https://github.com/huggingface/accelerate/issues/4233"),
    diffs=("accelerate/0005-skip-first-batches-epoch-1.7.0-1.14.0.patch",),
    note=("skip_first_batches keeps its object, name and line numbers but runs code rebuilt from the installed file, "
          "whose loaders take the iteration of the loader given"),
)
