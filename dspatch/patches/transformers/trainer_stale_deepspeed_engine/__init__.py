"""`trainer.evaluate()` before `trainer.train()`, and `train()` twice, under DeepSpeed train as one `train()` alone.

Both fail under DeepSpeed on every transformers 4.44.0-5.24.0, on every stack tested (open upstream: PR 44889 proposes a
fix; see also transformers issue 26874). Two things of one Trainer outlive the engine they belong to:
- the engine itself: `train()` starts with `accelerator.free_memory()`, which destroys the engine accelerate tracks, but
  `model_wrapped` (and `deepspeed`) still hold it, so `_wrap_model(self.model_wrapped)` hands the destroyed engine back,
  `accelerator.prepare` is skipped, no training engine is built and the first backward fails: `AttributeError:
  'NoneType' object has no attribute 'backward'` (a second `train()` at ZeRO-2 and ZeRO-3; after an `evaluate()` at
  ZeRO-3, whose inference engine is the one held). On deepspeed 0.14.0-0.16.5 a destroyed ZeRO-3 engine also leaves a
  hook on the model that fails the next engine's first forward (`pop from an empty deque`).
- the DeepSpeed config, shared by every engine the Trainer builds and edited in place: `deepspeed_init` fills its "auto"
  values for one run (`evaluate()`: 0 training steps, then `train()` refuses with `ds scheduler.params.total_num_steps=0
  vs hf num_training_steps`; a first `train()`: its own steps), the inference init deletes the `optimizer` block (a
  later training engine would get another optimizer than configured), and DeepSpeed pops `torch_adam`/`adam_w_mode` from
  the optimizer's params (a second engine gets another Adam). With explicit scheduler steps, `evaluate()` itself refuses
  (`... vs hf num_training_steps (calculated)=0`).

The fix, only where DeepSpeed is enabled:
- `Trainer._inner_training_loop` (what `train()` runs) first takes every engine an earlier `evaluate()` or `train()`
  left behind off the model (destroyed; ZeRO-3 with the hook 0.14.0-0.16.5 leave, see dspatch/patches/engine_handover.py),
  points `model_wrapped` back at the model, and puts the DeepSpeed config back as it was before any engine was built (in
  place: the same objects, which `is_deepspeed_zero3_enabled()` reads). The loop then builds its engine from the config
  as configured, exactly as a first `train()`.
- `Trainer.evaluation_loop` (and `prediction_loop`, up to 4.57), when it is about to build an inference engine (no
  engine yet), keeps the config as configured first, and takes out the scheduler block, which an engine with no
  optimizer never builds and which, with explicit steps, refuses 0 of them. An evaluation after training uses the
  training engine, as before.

What a run that evaluates before training or trains twice then does equals one `train()` alone: the losses, the learning
rate at every step, the final weights, the optimizer and scheduler configured. Proven on the old, bridge, mid and latest
stacks against a fresh Trainer's single `train()`, bit for bit (losses, learning rate per step, weights, optimizer and
scheduler classes); `evaluate()`'s loss equals the same Trainer's without DeepSpeed.

Left as upstream has it: at ZeRO-1/2 an evaluation before training is refused (`ZeRO inference only makes sense with
ZeRO Stage 3`, by design; PR 44889 would lift it). A `train()` after a caught refusal restores the config the refusal
left edited, and trains as configured.

The copy of the config is kept per accelerate DeepSpeedPlugin (weakly), taken the first time either loop runs, before
anything fills it: a new plugin (hyperparameter_search's next trial) is kept anew.
"""
from dspatch.spec import Patch, Signature, Target

TRAINER = "transformers.trainer"
LOOP = "Trainer._inner_training_loop"
EVALUATION = "Trainer.evaluation_loop"
PREDICTION = "Trainer.prediction_loop"

# every release 4.44.0-5.24.0 (python tests/upstream_releases.py <this id> 4.44.0 5.24.0 recomputes them)
TARGETS = (
    Target(TRAINER, LOOP, {"419064e85a84cdd2": "4.44.0-4.44.2", "f58cf18206848c07": "4.45.0-4.45.2",
           "973a19a66e71580d": "4.46.1", "517c903a761dd787": "4.46.2", "cabc488f69e433bb": "4.46.3",
           "7eb039186784bc2e": "4.47.0", "347f4c6c2dfefe20": "4.47.1-4.48.3", "09ee6adf0b594ab6": "4.49.0",
           "2a245920868e5036": "4.50.0-4.50.3", "bcca06c813a74b28": "4.51.0-4.51.3",
           "7ae46c3373085748": "4.52.1-4.52.4", "e85ca5f963c2394c": "4.53.0",
           "e5fe2d47a7ba78d2": "4.53.1-4.53.3", "1535aaddc82d8918": "4.54.0-4.54.1",
           "1bd100af9bbdbb3f": "4.55.0-4.56.2", "0f0445ff11bcfa8b": "4.57.1-4.57.6",
           "fe515e645af0dfc0": "5.0.0", "4efee8bbf78575ff": "5.1.0", "984bffd8698d4d37": "5.2.0",
           "d0691a2cf092144e": "5.3.0-5.18.0", "590175316694029b": "5.19.0-5.24.0"}),
    Target(TRAINER, EVALUATION, {"c16ffc573a11c002": "4.44.0-4.44.2", "d44efd98d5ac9324": "4.45.0-4.45.2",
           "2cebdec2ecca2f25": "4.46.1-4.47.0", "85a4237f41c1c3de": "4.47.1-4.49.0",
           "2d3dc039f008fee5": "4.50.0-4.51.3", "d51937ec916e325b": "4.52.1-4.55.4",
           "d2a77a7dd9f00b71": "4.56.0-4.57.6", "739d76c4d0704efe": "5.0.0-5.2.0",
           "c4eead036e59c79e": "5.3.0-5.22.2", "2e19554c1ee6e12a": "5.23.0-5.24.0"}),
    Target(TRAINER, PREDICTION, {"b4641af68599f49d": "4.44.0-4.44.2", "def6b0389dbb8718": "4.45.0-4.45.2",
           "24200cf26e7d6fae": "4.46.1-4.46.3", "1ea052a325393b82": "4.47.0-4.49.0",
           "424af24eec8fdf6e": "4.50.0-4.50.3", "bb90c8615d84f06d": "4.51.0-4.57.6"}, releases="<5.0.0"),
)
NONE_BACKWARD = "'NoneType' object has no attribute 'backward'"
ZERO_STEPS = "ds scheduler.params.total_num_steps=0 vs hf num_training_steps"


# id(DeepSpeedPlugin) -> (weakref to it, its config as it was before any engine, its mismatches list); the plugin is
# a dataclass (unhashable), held weakly: a new plugin (hyperparameter_search's next trial) is remembered anew
_configs: dict = {}


def _plugin(trainer):
    return trainer.accelerator.state.deepspeed_plugin


def _remember_config(plugin):
    import copy
    import weakref

    entry = _configs.get(id(plugin))
    if entry is None or entry[0]() is not plugin:
        hf = plugin.hf_ds_config
        key = id(plugin)
        entry = (weakref.ref(plugin, lambda _, key=key: _configs.pop(key, None)), copy.deepcopy(hf.config),
                 list(getattr(hf, "mismatches", [])))
        _configs[key] = entry
    return entry[1], entry[2]


def _engines_left(trainer):
    """The distinct DeepSpeed engines the Trainer or its accelerator still holds."""
    found = []
    holder = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
    for candidate in (trainer.model_wrapped, getattr(trainer, "deepspeed", None), getattr(holder, "engine", None)):
        if hasattr(candidate, "zero_optimization_stage") and all(candidate is not e for e in found):
            found.append(candidate)
    return found


def _training_loop(wrapped, instance, args, kwargs):
    trainer = instance
    if getattr(trainer, "is_deepspeed_enabled", False):
        import copy

        from dspatch.patches import engine_handover

        plugin = _plugin(trainer)
        config, mismatches = _remember_config(plugin)
        left = _engines_left(trainer)
        for engine in left:
            engine_handover.retire(engine, training_too=True)
        if left:
            trainer.accelerator.deepspeed_engine_wrapped = None  # destroyed: free_memory must not destroy it again
            trainer.model_wrapped = trainer.model
        trainer.deepspeed = None
        live = plugin.hf_ds_config
        if live.config != config:  # in place: the same objects (is_deepspeed_zero3_enabled reads them)
            live.config.clear()
            live.config.update(copy.deepcopy(config))
            if hasattr(live, "mismatches"):
                live.mismatches = list(mismatches)
        plugin.deepspeed_config = live.config
    return wrapped(*args, **kwargs)


def _inference_loop(wrapped, instance, args, kwargs):
    trainer = instance
    if getattr(trainer, "is_deepspeed_enabled", False) and getattr(trainer, "deepspeed", None) is None:
        # about to build an inference engine: the config as configured is kept for training (which restores it),
        # and the scheduler that an engine with no optimizer never builds is not checked against 0 steps
        plugin = _plugin(trainer)
        _remember_config(plugin)
        plugin.hf_ds_config.config.pop("scheduler", None)
    return wrapped(*args, **kwargs)


def apply(txn):
    txn.wrap(txn.target(LOOP), _training_loop)
    for target in txn.patch.targets:
        if target.qualname != LOOP:
            txn.wrap(txn.target(target.qualname), _inference_loop)


PATCH = Patch(
    id="transformers/trainer-stale-deepspeed-engine",
    summary=("evaluate() before train(), and train() twice, under DeepSpeed train as one train() alone: the engine "
             "left behind is taken off the model and the shared DeepSpeed config restored (no `'NoneType' object "
             "has no attribute 'backward'`, no `total_num_steps=0`)"),
    cause="An engine from `evaluate()` or an earlier `train()` stays on the model and its config",
    symptom="`'NoneType' object has no attribute 'backward'`, or `ds scheduler.params.total_num_steps=0`",
    distribution="transformers",
    affected=">=4.44.0",  # open upstream: the fingerprints decide
    fixed_in=None,
    supported=">=4.44.0",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/pull/44889",
           "https://github.com/huggingface/transformers/issues/26874"),
    # one diff per band of releases whose trainer.py differs around its lines (each applies as it is); the last one
    # is the one to forward upstream
    diffs=("transformers/0005-trainer-stale-deepspeed-engine-4.44.0-4.51.3.patch",
           "transformers/0005-trainer-stale-deepspeed-engine-4.52.1-4.52.4.patch",
           "transformers/0005-trainer-stale-deepspeed-engine-4.53.0-4.57.6.patch",
           "transformers/0005-trainer-stale-deepspeed-engine-5.0.0-5.1.0.patch",
           "transformers/0005-trainer-stale-deepspeed-engine-5.2.0.patch",
           "transformers/0005-trainer-stale-deepspeed-engine-5.3.0-5.24.0.patch"),
    # the same lines come from a model that never went through DeepSpeed's prepare: only an earlier evaluation's or
    # training's output in the log points to this cause
    signatures=(Signature(r"'NoneType' object has no attribute 'backward'", error="AttributeError",
                          needs=(r"transformers[/\\]trainer\.py", r"accelerate[/\\]accelerator\.py"),
                          hints=(r"'eval_loss': |'train_runtime': |Training completed\. ",),
                          tell="the Trainer trained before, or evaluated before training, in the same process",
                          also="a model that never went through DeepSpeed's prepare (accelerate's "
                               "deepspeed_engine_wrapped stays None)"),
                Signature(r"ds scheduler\.params\.total_num_steps=0 vs hf num_training_steps", error="ValueError",
                          tell="the Trainer evaluated before training (ZeRO-3)")),
    note=("Trainer._inner_training_loop, evaluation_loop and prediction_loop are wrapped: once per train() or "
          "evaluation, nothing per step"),
)
