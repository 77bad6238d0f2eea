"""DPO and KTO with a precomputed reference under DeepSpeed: the reference pass's engine is let go once its
forwards are done (trl 1.9.0-1.16.0, open upstream).

With `precompute_ref_log_probs=True` and no `ref_model`, `_precompute_ref_logps` (DPOTrainer's and KTOTrainer's
twin, introduced by trl PR 6403) wraps the policy in a DeepSpeed inference engine (`prepare_deepspeed`: ZeRO-3 at
ZeRO-3, stage 0 otherwise), computes the reference log-probs through it, and keeps it in
`self._precompute_engine` for later passes. `Trainer.train` then builds the training engine on the same model. At
ZeRO-3 the kept engine's hooks stay on every submodule: its coordinator replays a trace whose module ids the
training engine renumbered, and when the reference pass took a single batch (its trace still recording) the first
training forward fails: `IndexError: pop from an empty deque` (deepspeed >= 0.15.4). With more batches it trains,
with every parameter fetched by two engines. (dspatch's deepspeed/initialize-once refused that second
`deepspeed.initialize` outright before it learnt to hand a model over from an inference engine.)

The fix: each reference pass builds its engine, uses it, and takes it off the model when the pass ends
(`destroy()`, and the root hook that deepspeed 0.14.0-0.16.5's destroy() leaves behind: patches/engine_handover.py).
A pass that comes once the Trainer has its own engine (a dataset given to `evaluate()` after training, PEFT) uses
that engine, whose hooks already gather the parameters, instead of building a second one on a model a live
training engine holds. The reference log-probs are those of the same model without DeepSpeed, and training then
follows the run without DeepSpeed.

Targets: `DPOTrainer._precompute_ref_logps` and `KTOTrainer._precompute_ref_logps`, wrapped (once per pass,
nothing per step).
"""
from dspatch.spec import Patch, Signature

DPO = ("trl.trainer.dpo_trainer", "DPOTrainer._precompute_ref_logps")
KTO = ("trl.trainer.kto_trainer", "KTOTrainer._precompute_ref_logps")
# every release 1.9.0-1.16.0 (1.8.x precompute under ZeRO-3 with no engine at all: `'weight' must be 2-D`)
COORDINATOR_FRAME = r"partitioned_param_coordinator\.py|__step_id_module_fetched_for"
TRAINER_FRAME = r"trl[/\\](trainer|experimental[/\\]kto)[/\\](dpo|kto)_trainer\.py"
PRECOMPUTE = r"Computing reference log probs for \S+ dataset|_precompute_ref_logps"
FINGERPRINTS = {DPO: {"92ec8afb39be8c0a": "1.9.0-1.9.2", "09a63f9c1c693d8c": "1.10.0-1.14.1",
                      "1012df6855c857a9": "1.14.2-1.16.0"},
                KTO: {"ca51e83a29a6dfe7": "1.9.0-1.9.2", "347e2020354e81cc": "1.10.0-1.14.1",
                      "4d98ab9cfffcfe7c": "1.14.2-1.16.0"}}


def _trainers_engine(trainer):
    """The DeepSpeed engine the Trainer itself holds (built by train(), or by evaluate() at ZeRO-3), or None."""
    engine = getattr(trainer, "deepspeed", None)
    return engine if engine is not None and hasattr(engine, "zero_optimization_stage") else None


def _precompute_pass(wrapped, instance, args, kwargs):
    from dspatch.patches import engine_handover

    trainer = instance
    own = _trainers_engine(trainer)
    if own is not None:  # the Trainer's engine is on the model already: its hooks gather what the pass needs
        trainer._precompute_engine = own
        try:
            return wrapped(*args, **kwargs)
        finally:
            trainer._precompute_engine = None
    try:
        return wrapped(*args, **kwargs)
    finally:
        engine, trainer._precompute_engine = trainer._precompute_engine, None
        if engine is not None:  # the pass built it: off the model before anything else is built on it
            engine_handover.retire(engine)


def apply(txn):
    for _, qualname in (DPO, KTO):
        txn.wrap(txn.target(qualname), _precompute_pass)


PATCH = Patch(
    id="trl/precompute-ref-zero3-engine",
    summary=("DPO/KTO with precompute_ref_log_probs under DeepSpeed let go of the reference pass's engine when the "
             "pass ends, so the training engine is alone on the model (ZeRO-3: no `pop from an empty deque`)"),
    distribution="trl",
    affected=">=1.9.0",  # open upstream: the fingerprints decide
    fixed_in=None,
    supported=">=1.9.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/trl/pull/6403", "https://github.com/huggingface/trl/issues/2985"),
    # one diff per band of releases whose files differ around its lines (each applies as it is); the last one is
    # the one to forward upstream
    diffs={">=1.9.0,<=1.12.0": "trl/0004-precompute-ref-zero3-engine-1.9.0-1.12.0.patch",
           "==1.13.0": "trl/0004-precompute-ref-zero3-engine-1.13.0.patch",
           ">=1.14.0,<=1.14.1": "trl/0004-precompute-ref-zero3-engine-1.14.0-1.14.1.patch",
           "==1.14.2": "trl/0004-precompute-ref-zero3-engine-1.14.2.patch",
           ">=1.15.0,<=1.16.0": "trl/0004-precompute-ref-zero3-engine.patch"},
    # the deque the training forward writes is the one of every ZeRO-3 trace replayed with renumbered modules: its
    # traceback runs through DPO's or KTO's loss, and only the reference pass's progress line (trl's tqdm
    # description) or a frame of it tells this cause from another engine left on the model
    signatures=(Signature(r"pop from an empty deque", error="IndexError", context=(COORDINATOR_FRAME,),
                          needs=(TRAINER_FRAME,), hints=(PRECOMPUTE,),
                          tell="the log shows trl's reference pass (`Computing reference log probs for ... dataset`) "
                               "before training, with precompute_ref_log_probs=True and no ref_model (trl 1.9.0+)",
                          also="another engine left on the model (a reference or inference engine built on the "
                               "policy and kept, outside trl's precompute pass)"),),
    note="DPOTrainer/KTOTrainer._precompute_ref_logps are wrapped: once per reference pass, nothing per step",
)
