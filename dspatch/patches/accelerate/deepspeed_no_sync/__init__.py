"""Gradient accumulation under ZeRO-2/3 no longer dies on DeepSpeed's `no_sync` (accelerate < 1.9, deepspeed >= 0.16).

deepspeed 0.16.0 added `DeepSpeedEngine.no_sync()`, a context manager that skips the gradient all-reduce of the backward
passes inside it, and asserts that the engine does not partition gradients: `AssertionError: no_sync context manager is
incompatible with gradient partitioning logic of ZeRO stage 2` (or 3). accelerate's `Accelerator.no_sync(model)` enters
`model.no_sync()` whenever the job is distributed and the model has one, and `Accelerator.accumulate(model)` enters
`Accelerator.no_sync` on every micro-step that is not an accumulation boundary. So with deepspeed >= 0.16 and accelerate
<= 1.8.1, every multi-process job with gradient accumulation at ZeRO-2 or ZeRO-3 fails on its first micro-step, in
custom loops (`accelerator.accumulate`, `accelerator.no_sync`) and in the Trainer (transformers 4.46.2-4.47.0 call
`accelerator.no_sync` directly on the micro-steps of an accumulation window; earlier releases go through `accumulate`).
Upstream: deepspeedai/DeepSpeed issue 6793, huggingface/transformers issue 34984 and PR 35157 (4.47.1: the Trainer stops
calling no_sync under DeepSpeed), huggingface/accelerate issue 3481 and PR 3656 (1.9.0: `Accelerator.no_sync` enters the
model's `no_sync` under DeepSpeed only below ZeRO stage 2).

What the fix does, as accelerate 1.9.0 does: under DeepSpeed at ZeRO stage >= 2 (the stage of accelerate's active
DeepSpeed plugin), `Accelerator.no_sync` is a no-op; DeepSpeed itself knows the accumulation boundary (accelerate puts
its `gradient_accumulation_steps` in the DeepSpeed config) and reduces the partitioned gradients of every micro-step as
it must. ZeRO-0/1 and every other distributed type keep calling the model's `no_sync`, as before.

How: `Accelerator.no_sync` is rebuilt from the installed source (`txn.recode`) with its one statement `context =
getattr(model, "no_sync", context)` put under `if not <this module>.partitions_gradients(self):`. No wrapper; the
function object, its `@contextmanager` decorator, name and line numbers stay accelerate's.

Transformers: no patch of its own. The Trainer of 4.46.2-4.47.0 reaches DeepSpeed's no_sync only through
`Accelerator.no_sync`, which this patch fixes; with accelerate >= 1.9.0 upstream's own fix covers it. (transformers
4.47.1 skips no_sync under DeepSpeed at every stage; at ZeRO-0/1 DeepSpeed communicates only at the boundary anyway, so
keeping its no_sync there changes no number.)

The gate combines two packages: accelerate 0.26.0-1.8.1 (one released source of `Accelerator.no_sync`) *and*
deepspeed >= 0.16.0 (`requires`); with an older deepspeed `model.no_sync` does not exist (the engine forwards the name
to the model, which has none) and the verdict is "not affected"; `--check` names the pair of versions it saw.

The reproducers need two processes (accelerate uses the model's no_sync only when the job is distributed): one `torchrun
--nproc_per_node 2` job of `python -m <this module>` runs every case, its ranks carrying the patch state of the process
that runs the scenarios (see `_worker_env`). "Trains correctly" is checked against references, bit for bit (losses and
the optimizer's full fp32 parameters after 2 optimizer steps of 2 micro-steps, each rank its own batches):
- in the same job: `accumulate` at ZeRO-2/3 against the same loop with `sync_each_batch=True`, which never enters
  no_sync (what upstream's fix makes no_sync be there); `accelerator.no_sync` around DeepSpeed's own loop at ZeRO-2
  against that loop without it;
- in the tests: every case (the Trainer's included) against the same job with upstream's fix (the diff in upstream_prs/,
  accelerate 1.9.0's change) applied to a copy of the installed accelerate, no monkeypatch; the cases that hit no bug
  (ZeRO-1, the references) against stock; and on accelerate 1.10.1 (fixed upstream) the same job runs stock and passes
  the same checks. (Checked once by hand across stacks: every custom-loop case of accelerate 1.8.1 + deepspeed 0.16.9
  patched equals accelerate 1.10.1 + deepspeed 0.16.3 stock, bit for bit; the Trainer's numbers differ there,
  transformers 4.46.3 against 4.57.6.)

Seen on the way: at ZeRO-1, `accumulate` entering DeepSpeed's no_sync trains differently from the same loop with
`sync_each_batch=True` (third loss 0.0681 against 0.0615 in this job). It is a DeepSpeed bug of 0.16.0-0.18.2: inside
no_sync the loss is not divided by the accumulation, so those micro-steps count GA times too much; patched by
`deepspeed/grad-accum-scale-no-allreduce`.
"""
from dspatch.spec import Patch, Signature

ACCELERATOR = "accelerate.accelerator"
NO_SYNC = "Accelerator.no_sync"

# The released source of the target (tests/test_releases.py recomputes it from every sdist):
# unchanged from 0.20.0 to 1.8.1; 1.9.0 is upstream's fix.
FINGERPRINTS = {(ACCELERATOR, NO_SYNC): {"3c6094b633f6a292": "0.20.0-1.8.1"}}

ASSERTION = "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage"


def partitions_gradients(accelerator):
    """Whether `accelerator` drives DeepSpeed at ZeRO stage >= 2, whose engine partitions gradients and cannot
    skip their reduction (its no_sync asserts)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return False
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage >= 2


def _guard_model_no_sync(definition):
    """Transform: `context = getattr(model, "no_sync", ...)` -> the same under
    `if not partitions_gradients(self):`."""
    from dspatch.rewrite import call_into, find_statement, statement

    block, index = find_statement(definition, "_ = getattr(_, 'no_sync', _)", "`context = getattr(model, \"no_sync\", context)`")
    node = block[index]
    guard = statement(f"if not {call_into(__name__, 'partitions_gradients')}(self):\n    pass", node)
    guard.body = [node]
    block[index] = guard


def apply(txn):
    txn.recode(txn.patch.targets[0], _guard_model_no_sync)


PATCH = Patch(
    id="accelerate/deepspeed-no-sync",
    summary=("Gradient accumulation at ZeRO-2/3 (accelerate's accumulate/no_sync, the Trainer) no longer fails on "
             "deepspeed >= 0.16's no_sync assertion"),
    cause="accelerate enters DeepSpeed's `no_sync` while accumulating, which deepspeed >= 0.16 refuses at ZeRO-2/3",
    symptom="`AssertionError: no_sync context manager is incompatible with gradient partitioning logic`",
    distribution="accelerate",
    affected="<1.9.0",
    fixed_in="1.9.0",
    requires={"deepspeed": ">=0.16.0"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6793",
           "https://github.com/huggingface/accelerate/issues/3481",
           "https://github.com/huggingface/accelerate/pull/3656",
           "https://github.com/huggingface/transformers/issues/34984",
           "https://github.com/huggingface/transformers/pull/35157"),
    # transformers 4.46 (the Trainer's direct no_sync call) needs accelerate >= 0.26.0; the release tests cover
    # 0.26.0-1.8.1, all one source of Accelerator.no_sync
    supported=">=0.26.0",
    diffs=("accelerate/0002-deepspeed-no-sync-0.26.0-1.8.1.patch",),
    signatures=(Signature(r"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage",
                          error="AssertionError"),),
    note=("Accelerator.no_sync keeps its object, name and line numbers but runs code rebuilt from the installed "
          "file: under DeepSpeed at ZeRO stage >= 2 it no longer enters the engine's no_sync (as accelerate >= 1.9.0)"),
)

