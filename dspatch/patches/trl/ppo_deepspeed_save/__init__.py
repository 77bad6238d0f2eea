"""trl's PPO trainer saves the trained policy under DeepSpeed (`save_model` and the checkpoints at `save_steps`).

The PPO trainer trains a `PolicyAndValueWrapper` (the policy and the value model in one module) inside one DeepSpeed
engine. Its `save_model` saves "only the policy" by setting `self.model = self.model.policy` (through
`DeepSpeedEngine.__getattr__`, the bare policy) and then `self.deepspeed = self.model`, before calling
`Trainer.save_model`, which gathers the weights with `accelerator.get_state_dict(self.deepspeed)` and so needs the
engine. On transformers 4.x that fails at ZeRO-3 with `AttributeError: 'LlamaForCausalLM' object has no attribute
'zero_gather_16bit_weights_on_model_save'` (at ZeRO-1/2 it happens to work: accelerate reads the bare model's own state
dict); on transformers 5.x, whose `save_model` first reads `self.deepspeed.config.get(...)` (the engine's DeepSpeed
config), at every ZeRO stage with `AttributeError: 'LlamaConfig' object has no attribute 'get'`. The checkpoints written
during training fail the same way (`_save_checkpoint` calls `save_model(_internal_call=True)`), so a ZeRO-3 PPO job dies
at its first `save_steps`. Behind that, on transformers 5.x with several processes, `Trainer.save_model` calls `_save`
on every rank, and its non-main ranks read `self.is_distributed_loading_by_transformers`, which `Trainer.__init__` sets
and trl's PPO trainer (which does not call it) never has: `AttributeError` on rank 1 once the first failure is out of
the way.

trl issues 2122 (closed, workaround in its comments) and 2885 (open; cause confirmed by a maintainer); no fix merged.
Every release 0.11.0-1.12.0 has the same `save_model` (three fingerprints: type hints and a `hasattr` guard changed);
0.10.x has it too but never sets `self.deepspeed` at all (trl#2025) and fails before this bug (not covered); 0.9.x
gathered from the engine and stripped the `policy.` prefix itself (not affected); 1.13.0 removed PPO.

The fix, as in `upstream_prs/trl/0001-*.patch`: `self.deepspeed` stays the engine, so that `Trainer.save_model` gathers
the full weights from it on every rank (a collective at ZeRO-3: every rank must take part) and keeps its own logic (main
process writes, the fallback when ZeRO-3 16-bit gathering is off, push to hub, PEFT); the state dict handed to `_save`
is reduced to the policy's entries without their `policy.` prefix (no value-model weights), and `_save` writes the
policy (`save_pretrained`) with them, its tokenizer / processing class as stock does, on the main process only
(`args.should_save`, as transformers 4.x's caller already does). Without DeepSpeed nothing changes.
`AutoModelForCausalLM.from_pretrained(dir)` then loads exactly the trained policy. Proven with 2 ranks on the old,
bridge and mid stacks. (A flake of that test on bridge, one tensor differing now and then under load, was DeepSpeed's
own: the test's reference gathered every weight at once, see deepspeed/zero3-gather-waits-all; references are now
gathered one weight at a time.)

The PPO trainer lives in a different module in each band of releases (0.11.x `trl/trainer/ppov2_trainer.py`,
0.12.0-0.25.1 `trl/trainer/ppo_trainer.py`, 0.26.0-1.12.0 `trl/experimental/ppo/ppo_trainer.py`): one target per band,
each declaring its releases (`Target(..., releases=...)`), so that a release is gated and patched on the target it has.
How: `save_model` is wrapped (one target per release). With DeepSpeed off the wrapper calls upstream's function
untouched; with it on it runs the fixed save: the policy as `self.model`, the engine as `self.deepspeed`,
`Trainer.save_model` (the next class in the MRO) called with, for the length of the call only, an instance attribute
`_save` that strips the state dict before calling the class's own `_save` (so a subclass's `_save` still runs). Nothing
runs per training step.
"""
import functools

from dspatch.spec import Patch, Signature, Target

PPOV2 = "trl.trainer.ppov2_trainer"
PPO = "trl.trainer.ppo_trainer"
EXPERIMENTAL = "trl.experimental.ppo.ppo_trainer"

# The released source of save_model in each band (tests/test_releases.py recomputes them from
# every sdist): 0.25.0 changed `Optional[str]` to `str | None`, 0.29.0 added `if hasattr(self.model, "policy")`.
TARGETS = (
    Target(PPOV2, "PPOv2Trainer.save_model", {"054c3942bd1f272e": "0.11.0-0.11.4"}, releases=">=0.11.0,<0.12.0"),
    Target(PPO, "PPOTrainer.save_model", {"054c3942bd1f272e": "0.12.0-0.24.0", "a97148c67e89826f": "0.25.0-0.25.1"},
           releases=">=0.12.0,<0.26.0"),
    Target(EXPERIMENTAL, "PPOTrainer.save_model", {"a97148c67e89826f": "0.26.0-0.28.0",
                                                   "4de6f0b0aaf98f4f": "0.29.0-1.12.0"}, releases=">=0.26.0"),
)

PREFIX = "policy."


def policy_state_dict(state_dict):
    """The policy's entries of a state dict gathered from the engine of `PolicyAndValueWrapper`, under the
    policy's own names; any other state dict (none of its keys is the policy's) as it is."""
    if not state_dict or not any(key.startswith(PREFIX) for key in state_dict):
        return state_dict
    return type(state_dict)((key[len(PREFIX):], value) for key, value in state_dict.items() if key.startswith(PREFIX))


_MISSING = object()


def save_policy(trainer, owner, output_dir=None, _internal_call=False):
    """PPO's save_model under DeepSpeed, fixed: Trainer.save_model with the engine as `self.deepspeed`, the
    policy as `self.model`, and `_save` given the policy's weights only."""
    engine = trainer.model
    policy = engine.policy if hasattr(engine, "policy") else engine
    state = vars(trainer)
    before = {name: state.get(name, _MISSING) for name in ("model", "deepspeed", "_save")}
    write = before["_save"] if before["_save"] is not _MISSING else functools.partial(type(trainer)._save, trainer)

    def _save(output_dir=None, state_dict=None):
        if not trainer.args.should_save:
            # transformers 5 calls _save on every rank, whose non-main ranks read an attribute trl's trainer never
            # sets (is_distributed_loading_by_transformers): under DeepSpeed the main process alone writes
            return None
        return write(output_dir, state_dict=policy_state_dict(state_dict))

    trainer.model = policy
    trainer.deepspeed = engine
    trainer._save = _save
    try:
        return super(owner, trainer).save_model(output_dir, _internal_call)
    finally:
        for name, value in before.items():
            if value is _MISSING:
                state.pop(name, None)
            else:
                state[name] = value


def apply(txn):
    for target in txn.patch.targets:
        owner = txn.resolve(target)[0]

        def save_model(wrapped, instance, args, kwargs, _owner=owner):
            if instance is None or not getattr(instance, "is_deepspeed_enabled", False):
                return wrapped(*args, **kwargs)
            return save_policy(instance, _owner, *args, **kwargs)

        txn.wrap(target, save_model)


PATCH = Patch(
    id="trl/ppo-deepspeed-save",
    summary="PPO save_model and its checkpoints under DeepSpeed write the trained policy (gathered from the engine)",
    cause="trl's PPO save reads DeepSpeed settings from an object that does not have them",
    symptom="`AttributeError: ... no attribute 'zero_gather_16bit_weights_on_model_save'` (or `'get'`)",
    distribution="trl",
    affected=">=0.11.0,<1.13.0",  # open upstream; 1.13.0 removed PPO; 0.10.x fails earlier (trl#2025)
    fixed_in=None,
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/huggingface/trl/issues/2885", "https://github.com/huggingface/trl/issues/2122"),
    supported=">=0.11.0",
    # one diff per file location; made with 2 lines of context, each applies to every release of its band
    diffs=("trl/0001-ppo-deepspeed-save-ppov2_trainer-0.11.0-0.11.4.patch",
           "trl/0001-ppo-deepspeed-save-ppo_trainer-0.12.0-0.25.1.patch",
           "trl/0001-ppo-deepspeed-save-experimental-0.26.0-1.12.0.patch"),
    # not 'NoneType' (an older trl/transformers bug with another cause: no engine at all)
    signatures=(Signature(r"'(?!NoneType')\w+' object has no attribute 'zero_gather_16bit_weights_on_model_save'",
                          error="AttributeError"),
                Signature(r"'\w+Config' object has no attribute 'get'", error="AttributeError",
                          needs=(r"transformers[/\\]trainer\.py\", line \d+, in save_model",))),
    note=("open upstream (trl issues 2885, 2122): gated by the source of save_model in each band of releases. "
          "The PPO trainer's save_model is wrapped: without DeepSpeed it runs upstream's code untouched; with "
          "DeepSpeed it saves the policy with the weights gathered from the engine on every rank (the main "
          "process writes). trl 0.10.x has the same save_model but fails earlier (self.deepspeed is never set, "
          "trl#2025): not covered"),
)
