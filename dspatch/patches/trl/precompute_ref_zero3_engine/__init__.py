"""DPO with a precomputed reference at ZeRO-3: the reference pass's engine forgets its trace once its forwards are done.

DPO and KTO with `precompute_ref_log_probs=True` and no `ref_model`, on trl 1.9.0-1.16.0 (open upstream), compute the
reference through a DeepSpeed inference engine on the policy and keep it: `_precompute_ref_logps` (DPOTrainer's and
KTOTrainer's twin, introduced by trl PR 6403) wraps the policy in that engine (`prepare_deepspeed`: ZeRO-3 at ZeRO-3,
stage 0 otherwise), computes the reference log-probs through it, and keeps it in `self._precompute_engine` for later
passes. `Trainer.train` then builds the training engine on the same model, which renumbers its modules. At ZeRO-3 the
kept engine's hooks stay on every submodule: its coordinator replays a trace whose module ids the training engine
renumbered, and when the reference pass took a single batch (its trace still recording) the first training forward
fails: `IndexError: pop from an empty deque` (deepspeed >= 0.15.4; seen on the mid and latest stacks). With more batches
it trains, with every parameter fetched by two engines. (dspatch's deepspeed/initialize-once refused that second
`deepspeed.initialize` outright, before it let a model held by an inference engine through.) trl 1.8.x precomputes under
ZeRO-3 with no engine at all and fails otherwise (`'weight' must be 2-D`): not this patch's.

The cause is the kept engine's trace, not the engine itself: after a single forward it is still recording, and the next
forward (the training engine's, which renumbered the modules) completes it from module ids that no longer match. The
fix: when a reference pass ends, the engine it used forgets its trace (its parameter coordinator's trace is invalidated,
dspatch/patches/engine_handover.py), so that the next forward records one afresh; trl keeps and reuses the engine as before.
With two batches or more stock already trains so (its trace recorded and complete before the training engine exists):
the fixed run trains exactly as that one, bit for bit. Proven against the same training without DeepSpeed: reference
log-probs equal; losses within 1e-4 and weights within 1e-5 at ZeRO-3; ZeRO-2 bit-identical. The no-harm matrix runs it
with LoRA too.

Decided: taking the engine off the model instead (its `destroy()`) fixes the deque but breaks LoRA with gradient
checkpointing at ZeRO-3 on deepspeed 0.19.8 (`CheckpointError`: frozen weights recomputed with shape [0]), which trains
on stock with the engine kept: not done.

Target: `DPOTrainer._precompute_ref_logps`, wrapped (once per pass, nothing per step). KTOTrainer's twin is
trl/precompute-ref-zero3-engine-kto (dspatch/patches/trl/precompute_ref_zero3_engine_kto/__init__.py): a patch applies once all its
modules are imported, and a DPO job never imports the KTO trainer. `python -m dspatch.explain` names this bug where the
log shows trl's reference pass (`Computing reference log probs for ... dataset`) and the trainer's frame; otherwise it
is offered.
"""
from dspatch.spec import Patch, Signature

DPO = ("trl.trainer.dpo_trainer", "DPOTrainer._precompute_ref_logps")
KTO = ("trl.trainer.kto_trainer", "KTOTrainer._precompute_ref_logps")
# every release 1.9.0-1.16.0 (1.8.x precompute under ZeRO-3 with no engine at all: `'weight' must be 2-D`)
COORDINATOR_FRAME = r"partitioned_param_coordinator\.py|__step_id_module_fetched_for"
DPO_FRAME = r"trl[/\\]trainer[/\\]dpo_trainer\.py"
PRECOMPUTE = r"Computing reference log probs for \S+ dataset|_precompute_ref_logps"
FINGERPRINTS = {DPO: {"92ec8afb39be8c0a": "1.9.0-1.9.2", "09a63f9c1c693d8c": "1.10.0-1.14.1",
                      "1012df6855c857a9": "1.14.2-1.16.0"}}
KTO_FINGERPRINTS = {KTO: {"ca51e83a29a6dfe7": "1.9.0-1.9.2", "347e2020354e81cc": "1.10.0-1.14.1",
                          "4d98ab9cfffcfe7c": "1.14.2-1.16.0"}}


def _precompute_pass(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    finally:
        engine = getattr(instance, "_precompute_engine", None)
        if engine is not None:
            from dspatch.patches import engine_handover

            engine_handover.forget_trace(engine)


def apply(txn):
    for target in txn.patch.targets:
        txn.wrap(target, _precompute_pass)


def signature(trainer_frame):
    """The deque the training forward writes is the one of every ZeRO-3 trace replayed with renumbered modules: its
    traceback runs through the trainer's loss, and only the reference pass's progress line (trl's tqdm description)
    or a frame of it tells this cause from another engine left on the model."""
    return Signature(r"pop from an empty deque", error="IndexError", context=(COORDINATOR_FRAME,),
                     needs=(trainer_frame,), hints=(PRECOMPUTE,),
                     tell="the log shows trl's reference pass (`Computing reference log probs for ... dataset`) "
                          "before training, with precompute_ref_log_probs=True and no ref_model (trl 1.9.0+)",
                     also="another engine left on the model (a reference or inference engine built on the policy "
                          "and kept, outside trl's precompute pass)")


PATCH = Patch(
    id="trl/precompute-ref-zero3-engine",
    summary=("DPO with precompute_ref_log_probs under ZeRO-3: the reference pass's engine forgets its trace when the "
             "pass ends, so the training forward does not complete it with renumbered modules (no `pop from an "
             "empty deque`)"),
    cause=("DPO's reference pass at ZeRO-3 leaves a recorded module order behind that the training forward "
           "cannot follow"),
    symptom="`IndexError: pop from an empty deque` in the first training forward",
    distribution="trl",
    affected=">=1.9.0",  # open upstream: the fingerprints decide
    fixed_in=None,
    supported=">=1.9.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/trl/pull/6403", "https://github.com/huggingface/trl/issues/2985"),
    # one diff per band of releases whose files differ around its lines (each applies as it is); the last one is
    # the one to forward upstream
    diffs=("trl/0004-precompute-ref-zero3-engine-1.9.0-1.12.0.patch",
           "trl/0004-precompute-ref-zero3-engine-1.13.0.patch",
           "trl/0004-precompute-ref-zero3-engine-1.14.0-1.14.1.patch",
           "trl/0004-precompute-ref-zero3-engine-1.14.2.patch",
           "trl/0004-precompute-ref-zero3-engine-1.15.0-1.16.0.patch"),
    signatures=(signature(DPO_FRAME),),
    note="DPOTrainer._precompute_ref_logps is wrapped: once per reference pass, nothing per step",
)
