"""accelerate + deepspeed >= 0.19.3: a DeepSpeed scheduler whose warmup is "auto" starts with a `DummyScheduler` that
asks for no warmup (accelerate < 1.15.0).

deepspeed 0.19.3 made `WarmupLR` and `WarmupCosineLR` refuse a `warmup_num_steps` that is not a positive integer
(`ValueError: warmup_num_steps must be a positive integer, got 0`). `Accelerator.prepare` with DeepSpeed fills a config's
`"auto"` scheduler values from the `DummyScheduler` it is given, whose `warmup_num_steps` defaults to 0: every such
run fails at `deepspeed.initialize` once DeepSpeed alone is upgraded. accelerate 1.15.0 fills `max(1, ...)`, as
transformers 5.18.0 does for the Trainer (transformers/deepspeed-warmup-zero).

The fix is 1.15.0's, from outside: the `warmup_num_steps` that `Accelerator` hands to
`DeepSpeedPlugin.deepspeed_config_process` (the value an `"auto"` entry takes) is at least 1. Gated on deepspeed >=
0.19.3 (`requires`).

Proof: in the small session pairing deepspeed 0.19.8 with accelerate 1.10.1: an accelerate loop with a `DummyScheduler`
and an "auto" WarmupLR fails on stock and trains patched, with the learning rates of the same config giving
`warmup_num_steps: 1` itself.
"""
# deepspeed's refusal in its own words, as transformers/deepspeed-warmup-zero matches it
from dspatch.patches.transformers.deepspeed_warmup_zero import REFUSED
from dspatch.spec import Patch, Signature

DATACLASSES = "accelerate.utils.dataclasses"
PROCESS = "DeepSpeedPlugin.deepspeed_config_process"
# every release 0.34.0-1.14.0 (python tests/upstream_releases.py accelerate/deepspeed-warmup-zero 0.34.0 1.14.0)
FINGERPRINTS = {(DATACLASSES, PROCESS): {"d31ea188b358d74c": "0.34.0-1.9.0", "aef218637744e7cc": "1.10.0-1.14.0"}}
KEY = "scheduler.params.warmup_num_steps"


def positive_warmup(wrapped, instance, args, kwargs):
    """deepspeed_config_process(self, prefix, mismatches, config, must_match, **values): a warmup of 0 or less given
    for an "auto" entry is 1."""
    value = kwargs.get(KEY)
    if isinstance(value, int) and value <= 0:
        kwargs = {**kwargs, KEY: 1}
    return wrapped(*args, **kwargs)


def apply(txn):
    txn.wrap(txn.target(PROCESS), positive_warmup)


PATCH = Patch(
    id="accelerate/deepspeed-warmup-zero",
    summary=("accelerate: an \"auto\" DeepSpeed warmup_num_steps filled from a DummyScheduler without warmup is 1, not "
             "the 0 that deepspeed >= 0.19.3 refuses"),
    cause=("accelerate fills an \"auto\" warmup_num_steps from DummyScheduler's default of 0, which deepspeed 0.19.3 and "
           "later refuse"),
    symptom="`ValueError: warmup_num_steps must be a positive integer, got 0` in `accelerator.prepare`",
    distribution="accelerate",
    affected="<1.15.0",
    fixed_in="1.15.0",
    supported=">=0.34.0",
    requires={"deepspeed": ">=0.19.3"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/pull/48640",),
    diffs=("accelerate/0007-deepspeed-warmup-zero-0.34.0-1.14.0.patch",),
    # the Trainer's runs pass through accelerate too: a Trainer frame is transformers/deepspeed-warmup-zero's
    signatures=(Signature(REFUSED, error="ValueError", context=(r"accelerator\.py|_prepare_deepspeed",),
                          unless=(r"transformers/trainer\.py|_inner_training_loop|deepspeed_init",)),),
)
