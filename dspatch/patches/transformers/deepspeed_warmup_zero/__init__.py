"""Trainer + deepspeed >= 0.19.3: a DeepSpeed scheduler whose warmup is "auto" starts when the run asks for no warmup
(transformers 4.44-5.17).

deepspeed 0.19.3 made `WarmupLR` and `WarmupCosineLR` refuse a `warmup_num_steps` that is not a positive integer
(`ValueError: warmup_num_steps must be a positive integer, got 0`; 0.19.2 and earlier took 0 and warmed up over 2
steps). The Trainer fills an `"auto"` `warmup_num_steps` in `HfTrainerDeepSpeedConfig.trainer_config_finalize` with
`args.get_warmup_steps(...)`, which is 0 for a run without `warmup_steps` or `warmup_ratio`: every such run with a
DeepSpeed scheduler block fails at `deepspeed.initialize` once DeepSpeed alone is upgraded. transformers 5.18.0 (PR
48640) fills `max(1, ...)`; 1 step of warmup is what 0.19.2 made of 0 (its own `max(2, ...)` changes neither).

The fix is 5.18.0's, from outside: after `trainer_config_finalize`, a `warmup_num_steps` it filled from `"auto"` with
0 (or less) is 1. A value the config gives itself is left as it is. Gated on deepspeed >= 0.19.3 (`requires`).

Proof: a small session pairing deepspeed 0.19.8 with transformers 4.57.6 and accelerate 1.10.1 (users upgrade DeepSpeed
alone): a Trainer with an "auto" WarmupLR and no warmup fails on stock and trains patched, with the learning rates of
the same config giving `warmup_num_steps: 1` itself.
"""
from dspatch.spec import Patch, Signature

DS_INTEGRATION = "transformers.integrations.deepspeed"
FINALIZE = "HfTrainerDeepSpeedConfig.trainer_config_finalize"
# every release 4.44.0-5.17.0 (python tests/upstream_releases.py transformers/deepspeed-warmup-zero 4.44.0 5.17.0)
FINGERPRINTS = {(DS_INTEGRATION, FINALIZE): {"a0acb0255963d2b8": "4.44.0-4.44.2", "536188f058ed5069": "4.45.0-4.45.2",
                                            "de093ce226a4d804": "4.46.1-4.56.2", "0990e2836fc0bd62": "4.57.1-5.17.0"}}
REFUSED = r"warmup_num_steps must be a positive integer, got (0|-\d+)"


def _warmup(config):
    scheduler = config.get("scheduler") if isinstance(config, dict) else None
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    return params if isinstance(params, dict) else None


def positive_warmup(wrapped, instance, args, kwargs):
    """trainer_config_finalize(self, args, model, num_training_steps): an "auto" warmup it fills with 0 is 1."""
    params = _warmup(getattr(instance, "config", None))
    auto = params is not None and params.get("warmup_num_steps") == "auto"
    result = wrapped(*args, **kwargs)
    if auto:
        filled = params.get("warmup_num_steps")
        if isinstance(filled, int) and filled <= 0:
            params["warmup_num_steps"] = 1
    return result


def apply(txn):
    txn.wrap(txn.target(FINALIZE), positive_warmup)


PATCH = Patch(
    id="transformers/deepspeed-warmup-zero",
    summary=("Trainer: an \"auto\" DeepSpeed warmup_num_steps of a run without warmup is filled with 1, not the 0 "
             "that deepspeed >= 0.19.3 refuses"),
    cause=("The Trainer fills an \"auto\" warmup_num_steps with 0 for a run without warmup, which deepspeed 0.19.3 and "
           "later refuse"),
    symptom="`ValueError: warmup_num_steps must be a positive integer, got 0` at `deepspeed.initialize`",
    distribution="transformers",
    affected="<5.18.0",
    fixed_in="5.18.0",
    supported=">=4.44.0",
    requires={"deepspeed": ">=0.19.3"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/pull/48640",),
    diffs=("transformers/0009-deepspeed-warmup-zero-4.44.0-5.17.0.patch",),
    signatures=(Signature(REFUSED, error="ValueError", context=(r"trainer\.py|deepspeed_init|_inner_training_loop",)),),
)
