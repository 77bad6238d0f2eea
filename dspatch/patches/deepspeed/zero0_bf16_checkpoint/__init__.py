"""bf16 at ZeRO stage 0: `save_checkpoint` leaves the optimizer's state out, so a resumed run restarts Adam.

Since PR 7515 (0.17.6) a bf16 engine at ZeRO stage 0 trains with DeepSpeed's fp16 optimizer wrapper
(`FP16_UnfusedOptimizer` or `FP16_Optimizer`, running in bf16) instead of `BF16_Optimizer`. `_save_checkpoint` and
`_load_checkpoint` still decide where the optimizer's state goes with `self.zero_optimization() or
self.bfloat16_enabled()`: for bf16 they leave it out of the model file, as if a ZeRO file held it; but the fp16 wrapper
has no `dp_process_group`, so no ZeRO file is written either. On 0.18.0-0.18.4 `load_checkpoint` then silently keeps the
new engine's own state: Adam's step count and moments start anew and the resumed run drifts from the uninterrupted one
(measured on 0.18.2 and 0.18.3: Adam's `step` reads 1 after the load, the saved engine's 4; the weights a few per cent
off after one more step). On 0.17.6 `load_checkpoint` itself goes for the ZeRO files first, with the same test, and
fails with `AttributeError: 'FP16_UnfusedOptimizer' object has no attribute 'dp_process_group'` (0.18.0 asks only
`zero_optimization()` there). Fixed upstream in 0.18.5 (PR 7786), which drops `or self.bfloat16_enabled()` from the
tests.

The fix rebuilds both functions (on 0.17.6 `load_checkpoint` too) from the installed source with that one test replaced
by `state_elsewhere(self)` from this module: the optimizer's state is kept out of the model file only at ZeRO stages
>= 1, or in bf16 by an optimizer other than the fp16 wrapper (a `BF16_Optimizer`, which a bf16 engine built without an
optimizer gets; its state stays where stock puts it). So a bf16 stage-0 engine on the fp16 wrapper, fp32 gradient
accumulation included (it runs the same wrapper on 0.18.2 and 0.18.3), saves its state with the model and loads it back,
as fp16 and fp32 engines do. A checkpoint written by stock (no optimizer state in it) loads as on stock: the new engine
keeps its own optimizer state, as nothing else can be done with it. Nothing else changes: an engine that is not bf16 at
stage 0 on the fp16 wrapper takes the same branch as stock.

Composes with deepspeed/zero0-bf16-grads (the same engines' gradients): its static loss scale is part of the state
saved here and loads back with it.
"""
from dspatch.spec import Patch, Signature, Target

ENGINE = "deepspeed.runtime.engine"
SAVE, LOAD = "DeepSpeedEngine._save_checkpoint", "DeepSpeedEngine._load_checkpoint"
LOAD_ZERO_FIRST = "DeepSpeedEngine.load_checkpoint"  # 0.17.6: it goes for a ZeRO file first, for every bf16 engine
STOCK_TEST = "self.zero_optimization() or self.bfloat16_enabled()"

# every release 0.17.6-0.18.4 (python tests/upstream_releases.py deepspeed/zero0-bf16-checkpoint 0.17.6 0.18.4)
TARGETS = (Target(ENGINE, SAVE, {"16466514ffc15cbb": "0.17.6-0.18.4"}),
           Target(ENGINE, LOAD, {"a9f9f9703946a06a": "0.17.6-0.18.4"}),
           Target(ENGINE, LOAD_ZERO_FIRST, {"b062bec1dff6c016": "0.17.6"}, releases="<0.18.0"))


def state_elsewhere(engine, checkpoint=None):
    """Whether the optimizer's state is not the model file's to hold: ZeRO (its own files), or bf16 on a
    BF16_Optimizer (where stock keeps it). `checkpoint`, when loading: also where the file holds none (written by
    stock), so that the load goes on as stock's."""
    if engine.zero_optimization():
        return True
    if not engine.bfloat16_enabled():
        return False
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(engine.optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return True
    return checkpoint is not None and checkpoint.get("optimizer") is None


def _test_with(arguments):
    def transform(definition):
        from dspatch.rewrite import call_into, expression, find_one, replace

        stock = find_one(definition, STOCK_TEST)
        replace(definition, stock, expression(f"{call_into(__name__, 'state_elsewhere')}({arguments})", stock))

    return transform


def apply(txn):
    txn.recode(txn.target(SAVE), _test_with("self"))
    txn.recode(txn.target(LOAD), _test_with("self, checkpoint"))
    if txn.has(LOAD_ZERO_FIRST):  # 0.17.6
        txn.recode(txn.target(LOAD_ZERO_FIRST), _test_with("self"))


PATCH = Patch(
    id="deepspeed/zero0-bf16-checkpoint",
    summary="bf16 engines at ZeRO stage 0 save their optimizer's state with the model and load it back",
    cause="bf16 at ZeRO stage 0 keeps the optimizer's state out of the model file for a ZeRO file the fp16 optimizer "
          "wrapper it runs on never writes",
    symptom="a run resumed from a bf16 ZeRO-0 checkpoint restarts Adam (step count and moments anew)",
    distribution="deepspeed",
    affected=">=0.17.6,<0.18.5",
    supported=">=0.17.6",
    fixed_in="0.18.5",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/7786", "https://github.com/deepspeedai/DeepSpeed/pull/7515"),
    diffs=("deepspeed/0027-zero0-bf16-checkpoint-0.17.6.patch",
           "deepspeed/0027-zero0-bf16-checkpoint-0.18.0-0.18.4.patch"),
    # 0.17.6: load_checkpoint reads ZeRO files for a bf16 engine whose fp16 wrapper has no data-parallel group
    signatures=(Signature(r"'FP16_(Unfused)?Optimizer' object has no attribute 'dp_process_group'",
                          error="AttributeError",
                          needs=(r"_get_all_zero_checkpoint_state_dicts|_get_zero_ckpt_name|_load_zero_checkpoint",)),),
)
