"""Trainer + DeepSpeed: a config without `gradient_clipping` clips at `max_grad_norm`, as the Trainer does without
DeepSpeed.

Under DeepSpeed the Trainer does not clip the gradients itself: it hands `max_grad_norm` to DeepSpeed through the
config, in `HfTrainerDeepSpeedConfig.trainer_config_process`, whose `fill_match("gradient_clipping", max_grad_norm)`
fills the key only where it says `"auto"` (and checks only a key that is there). A config without the key, as many
published ones are, leaves `max_grad_norm` unused, silently: deepspeed before 0.19.3 does not clip at all (its default
is 0), 0.19.3 and later clip at 1.0 (DeepSpeed PR 8068) whatever the user asked for, 0.3 or 0 (no clipping). Seen on
every transformers release (open upstream; axolotl issue 1381, DeepSpeed issues 6743 and 7220, accelerate 3509 and 3807,
transformers 37566, trl 3312, open-r1 609). A Trainer step at ZeRO-2 with SGD at rate 1 and `max_grad_norm=0.01`
moves the weights by 1.007 on deepspeed 0.16.3 (unclipped) and by 1.0 on 0.19.8, where it should move them by 0.01.

The fix (decided in issue 49): a config with no `gradient_clipping` gets it filled from `max_grad_norm`, as `"auto"`
would be, before `trainer_config_process` fills the rest, and the Trainer logs one warning line that it did. A config
that sets the key, to a number or `"auto"`, is left as upstream has it (a number that differs from `max_grad_norm` is
refused by the Trainer's own consistency check, as on stock).

Proof: on the mid and latest stacks, one Trainer step at ZeRO-2, SGD at rate 1: with `max_grad_norm=0.01` the weights
move by 0.01; with `max_grad_norm=0` they move by the whole gradient (the norm the Trainer logs); a config that sets
`gradient_clipping` itself trains as on stock, bit for bit.
"""
from dspatch.spec import Patch

DS_INTEGRATION = "transformers.integrations.deepspeed"
PROCESS = "HfTrainerDeepSpeedConfig.trainer_config_process"
# every release 4.44.0-5.24.0 (python tests/upstream_releases.py transformers/deepspeed-max-grad-norm 4.44.0 5.24.0)
FINGERPRINTS = {(DS_INTEGRATION, PROCESS): {"1fe83dcc3856e696": "4.44.0-4.57.6", "871b09379135ac7a": "5.0.0-5.24.0"}}
KEY = "gradient_clipping"
_said: list = []


def fill_gradient_clipping(wrapped, instance, args, kwargs):
    """trainer_config_process(self, args, ...): a config without `gradient_clipping` gets it as `"auto"`, which the
    call fills from `max_grad_norm` with the other values."""
    config = getattr(instance, "config", None)
    if isinstance(config, dict) and KEY not in config:
        config[KEY] = "auto"
        if not _said:
            _said.append(True)
            from transformers.utils import logging

            training = args[0] if args else kwargs.get("args")
            logging.get_logger(DS_INTEGRATION).warning(
                f"dspatch (transformers/deepspeed-max-grad-norm): the DeepSpeed config has no gradient_clipping; "
                f"filled from max_grad_norm={getattr(training, 'max_grad_norm', '?')}, as \"auto\" is")
    return wrapped(*args, **kwargs)


def apply(txn):
    txn.wrap(txn.target(PROCESS), fill_gradient_clipping)


PATCH = Patch(
    id="transformers/deepspeed-max-grad-norm",
    summary=("Trainer + DeepSpeed: a config without gradient_clipping clips at max_grad_norm, filled as \"auto\" "
             "would be (one warning line says so)"),
    cause=("The Trainer hands max_grad_norm to DeepSpeed only through a gradient_clipping key set to \"auto\"; without "
           "the key DeepSpeed clips at its own default (none before 0.19.3, 1.0 since)"),
    canary=('clipping',),
    symptom="`max_grad_norm` silently ignored under DeepSpeed when the config has no `gradient_clipping`",
    distribution="transformers",
    affected=">=0",
    fixed_in=None,
    supported=">=4.44.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/issues/37566", "https://github.com/deepspeedai/DeepSpeed/pull/8068",
           "https://github.com/axolotl-ai-cloud/axolotl/issues/1381"),
    diffs=("transformers/0007-deepspeed-max-grad-norm-4.44.0-4.57.6.patch",
           "transformers/0007-deepspeed-max-grad-norm-5.0.0-5.24.0.patch"),
)
