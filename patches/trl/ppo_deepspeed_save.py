"""trl's PPO trainer saves the trained policy under DeepSpeed (`save_model` and the checkpoints at `save_steps`).

The PPO trainer trains a `PolicyAndValueWrapper` (the policy and the value model in one module) inside one
DeepSpeed engine. Its `save_model` saves "only the policy" by setting `self.model = self.model.policy` (through
`DeepSpeedEngine.__getattr__`, the bare policy) and then `self.deepspeed = self.model`, before calling
`Trainer.save_model`, which gathers the weights with `accelerator.get_state_dict(self.deepspeed)` and so needs
the engine. On transformers 4.x that fails at ZeRO-3 with `AttributeError: 'LlamaForCausalLM' object has no
attribute 'zero_gather_16bit_weights_on_model_save'` (at ZeRO-1/2 it happens to work: accelerate reads the bare
model's own state dict); on transformers 5.x, whose `save_model` first reads `self.deepspeed.config.get(...)`
(the engine's DeepSpeed config), at every ZeRO stage with `AttributeError: 'LlamaConfig' object has no attribute
'get'`. The checkpoints written during training fail the same way (`_save_checkpoint` calls
`save_model(_internal_call=True)`), so a ZeRO-3 PPO job dies at its first `save_steps`. Behind that, on
transformers 5.x with several processes, `Trainer.save_model` calls `_save` on every rank, and its non-main ranks
read `self.is_distributed_loading_by_transformers`, which `Trainer.__init__` sets and trl's PPO trainer (which
does not call it) never has: `AttributeError` on rank 1 once the first failure is out of the way.
trl issues 2122 (closed, workaround in its comments) and 2885 (open; cause confirmed by a maintainer); no fix
merged. Every release 0.11.0-1.12.0 has the same `save_model` (three fingerprints: type hints and a `hasattr`
guard changed); 0.10.x has it too but never sets `self.deepspeed` at all (trl#2025) and fails before this bug;
0.9.x gathered from the engine and stripped the `policy.` prefix itself (not affected); 1.13.0 removed PPO.

The fix, as in `upstream_prs/trl/0001-*.patch`: `self.deepspeed` stays the engine, so that `Trainer.save_model`
gathers the full weights from it on every rank (a collective at ZeRO-3: every rank must take part) and keeps its
own logic (main process writes, the fallback when ZeRO-3 16-bit gathering is off, push to hub, PEFT); the state
dict handed to `_save` is reduced to the policy's entries without their `policy.` prefix (no value-model
weights), and `_save` writes the policy (`save_pretrained`) with them, its tokenizer / processing class as
stock does, on the main process only (`args.should_save`, as transformers 4.x's caller already does). Without
DeepSpeed nothing changes.

The PPO trainer lives in a different module in each band of releases (0.11.x `trl/trainer/ppov2_trainer.py`,
0.12.0-0.25.1 `trl/trainer/ppo_trainer.py`, 0.26.0-1.12.0 `trl/experimental/ppo/ppo_trainer.py`): one target per
band, each declaring its releases (`Target(..., releases=...)`), so that a release is gated and patched on the
target it has. How: `save_model` is wrapped (one target per release). With DeepSpeed off the wrapper calls
upstream's function untouched; with it on it runs the fixed save: the policy as `self.model`, the engine as
`self.deepspeed`, `Trainer.save_model` (the next class in the MRO) called with, for the length of the call
only, an instance attribute `_save` that strips the state dict before calling the class's own `_save` (so a
subclass's `_save` still runs). Nothing runs per training step.
"""
import functools
import os

from dspatch.spec import BugSeen, Patch, Target

PPOV2 = "trl.trainer.ppov2_trainer"
PPO = "trl.trainer.ppo_trainer"
EXPERIMENTAL = "trl.experimental.ppo.ppo_trainer"

# The released source of save_model in each band (tests/test_gating_ppo_deepspeed_save.py recomputes them from
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


# ----------------------------------------------------------------------------------------------------
# Reproducers: real trl PPO training (2 steps) on CPU under accelerate + DeepSpeed, tiny Llama policy / reference /
# reward / value models built from configs, a tokenizer built in code, then save and reload.

VOCAB = 48


def ppo_classes():
    """(trainer class, config class) of the installed trl's PPO."""
    from packaging.version import Version

    from dspatch.gating import installed_version

    version = Version(installed_version("trl"))
    if version < Version("0.12"):
        from trl.trainer.ppov2_config import PPOv2Config as Config
        from trl.trainer.ppov2_trainer import PPOv2Trainer as Trainer
    elif version < Version("0.26"):
        from trl.trainer.ppo_config import PPOConfig as Config
        from trl.trainer.ppo_trainer import PPOTrainer as Trainer
    else:
        from trl.experimental.ppo import PPOConfig as Config, PPOTrainer as Trainer
    return Trainer, Config


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>",
                                   padding_side="left")


def models(seed=0):
    """policy, reference, reward and value models (tiny Llamas, built from configs)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                 tie_word_embeddings=False)
    config = LlamaConfig(**shape)
    torch.manual_seed(seed)
    policy = LlamaForCausalLM(config)
    ref = LlamaForCausalLM(config)
    ref.load_state_dict(policy.state_dict())
    scalar = LlamaConfig(**shape, num_labels=1)
    reward = LlamaForSequenceClassification(scalar)
    value = LlamaForSequenceClassification(scalar)
    return policy, ref, reward, value


def dataset(n=8):
    from datasets import Dataset

    rows = [[2 + (7 * i + j) % (VOCAB - 2) for j in range(4)] for i in range(n)]
    return Dataset.from_dict({"input_ids": rows})


def ds_config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "steps_per_print": 10**6, "zero_optimization": zero,
            "bf16": {"enabled": False}, "fp16": {"enabled": False}}


def _use_accelerate_deepspeed(stage, work):
    """The environment `accelerate launch --use_deepspeed --deepspeed_config_file ...` gives each process."""
    import json

    from dspatch.scenario import init_deepspeed

    path = os.path.join(work, f"zero{stage}.json")
    with open(path, "w") as f:
        json.dump(ds_config(stage), f)
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=path)
    init_deepspeed()  # gloo, rendezvous variables (torchrun's are kept)


def _no_accelerate_deepspeed():
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        os.environ.pop(name, None)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:
        pass
    else:
        unset_hf_deepspeed_config()  # from_pretrained below must not build a ZeRO-3 model
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def _past_generation_hooks_bug():
    """Whether ZeRO-3 generation would first hit another bug here (trl <= 0.15.2 with deepspeed >= 0.16.4:
    dspatch's trl/zero3-generation-hooks) which is not being fixed in this process. The reproducers then
    generate without gathering (`ds3_gather_for_generation=False`, which trl has since 0.13), so that they show
    this bug and nothing else."""
    from dspatch import _runtime, gating, registry

    other = registry.all_patches().get("trl/zero3-generation-hooks")
    return (other is not None and other.id not in _runtime.applied_ids()
            and gating.evaluate(other)[1] == gating.APPLIES)


def gathered_policy(module):
    """{name: full tensor} of the policy inside PolicyAndValueWrapper `module` (a collective at ZeRO-3)."""
    import deepspeed

    params = list(module.policy.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params)):
        return {name: p.detach().clone() for name, p in module.policy.named_parameters()}


def trainer_for(stage, work, output_dir, save_steps=None, deepspeed=True, world=1):
    """A PPO trainer ready to train 2 steps; records the gathered policy at every on_save (.saved_weights)."""
    from transformers import TrainerCallback

    _no_accelerate_deepspeed()
    policy, ref, reward, value = models()  # built as plain modules (ZeRO-3 partitions them at prepare)
    if deepspeed:
        _use_accelerate_deepspeed(stage, work)
    Trainer, Config = ppo_classes()
    saved = {}

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            saved[state.global_step] = gathered_policy(trainer.accelerator.unwrap_model(trainer.model))

    extra = {"ds3_gather_for_generation": False} if deepspeed and _past_generation_hooks_bug() else {}
    args = Config(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                  num_mini_batches=1, num_ppo_epochs=1, total_episodes=4 * world, response_length=4,
                  local_rollout_forward_batch_size=2, num_sample_generations=0, learning_rate=3e-2, seed=0,
                  report_to=[], disable_tqdm=True, bf16=False, logging_steps=1,
                  save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, **extra)
    if deepspeed:
        # The config's device setup made accelerate's PartialState (DeepSpeed, from the environment). accelerate
        # 1.1-1.9 then refuses the trainer's own bare `Accelerator()` ("Please make sure to properly initialize
        # your accelerator", another bug, fixed in accelerate 1.10): start the state afresh, as a process that
        # builds the trainer first would
        from accelerate.state import PartialState

        PartialState._reset_state()
    data = dataset()
    trainer = Trainer(args, tokenizer(), policy, ref, reward, data, value, None, data, callbacks=[Record()])
    trainer.saved_weights = saved
    return trainer


def check_saved(path, expected, what):
    """`path` holds the policy exactly: from_pretrained loads it with `expected`'s values, nothing else is in
    its weights file, and its tokenizer is there."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = sorted(f for f in os.listdir(path) if f.startswith(("model", "pytorch_model"))
                   and f.endswith((".safetensors", ".bin")))
    if not files:
        raise AssertionError(f"{what}: no weights in {path}: {sorted(os.listdir(path))}")
    keys = set()
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                keys |= set(f.keys())
        else:
            keys |= set(torch.load(os.path.join(path, name), weights_only=True))
    if keys != set(expected):
        raise AssertionError(f"{what}: the weights file holds {sorted(keys ^ set(expected))[:6]} (policy: "
                             f"{len(expected)} tensors)")
    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = model.state_dict()
    differ = [name for name, value in expected.items() if not torch.equal(loaded[name], value)]
    if differ:
        raise AssertionError(f"{what}: from_pretrained gives other values for {differ[:4]}")
    if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer().get_vocab():
        raise AssertionError(f"{what}: the tokenizer saved is not the trainer's")


def _bug(where, stage, error):
    text = str(error)
    if isinstance(error, AttributeError) and ("zero_gather_16bit_weights_on_model_save" in text
                                              or "object has no attribute 'get'" in text):
        raise BugSeen(f"{where} under ZeRO-{stage}: AttributeError: {text}") from error
    raise error


def _train_and_save(stage, save_steps):
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "out")
        trainer = trainer_for(stage, work, out, save_steps=save_steps)
        module = trainer.accelerator.unwrap_model(trainer.model)
        try:
            trainer.train()
        except AttributeError as e:
            _bug("checkpoint at save_steps", stage, e)
        final = os.path.join(work, "final")
        try:
            trainer.save_model(final)
        except AttributeError as e:
            _bug("save_model", stage, e)
        trained = gathered_policy(module)
        _no_accelerate_deepspeed()  # from here on, from_pretrained builds plain models
        if save_steps and sorted(trainer.saved_weights) != [1, 2]:
            raise AssertionError(f"checkpoints at steps {sorted(trainer.saved_weights)}, not [1, 2]")
        for step, weights in sorted(trainer.saved_weights.items()):
            check_saved(os.path.join(out, f"checkpoint-{step}"), weights, f"ZeRO-{stage} checkpoint-{step}")
        check_saved(final, trained, f"ZeRO-{stage} save_model")
        if save_steps and torch_equal(trainer.saved_weights[1], trained):
            raise AssertionError("the policy did not change between the first checkpoint and the end")


def torch_equal(a, b):
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def zero3_save():
    """ZeRO-3: 2 PPO steps with a checkpoint at every step, then save_model; each holds the trained policy."""
    _train_and_save(3, save_steps=1)


def zero2_save():
    """ZeRO-2: 2 PPO steps, then save_model (fails on transformers 5 only)."""
    _train_and_save(2, save_steps=None)


PATCH = Patch(
    id="trl/ppo-deepspeed-save",
    summary="PPO save_model and its checkpoints under DeepSpeed write the trained policy (gathered from the engine)",
    distribution="trl",
    affected=">=0.11.0,<1.13.0",  # open upstream; 1.13.0 removed PPO; 0.10.x fails earlier (trl#2025)
    fixed_in=None,
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/huggingface/trl/issues/2885", "https://github.com/huggingface/trl/issues/2122"),
    supported=">=0.11.0",
    # one diff per file location; made with 2 lines of context, each applies to every release of its band
    diffs={">=0.11.0,<0.12.0": "trl/0001-ppo-deepspeed-save-ppov2_trainer-0.11.0-0.11.4.patch",
           ">=0.12.0,<0.26.0": "trl/0001-ppo-deepspeed-save-ppo_trainer-0.12.0-0.25.1.patch",
           ">=0.26.0,<1.13.0": "trl/0001-ppo-deepspeed-save-experimental-0.26.0-1.12.0.patch"},
    scenarios={"zero3_save": zero3_save, "zero2_save": zero2_save},
    expected_on_stock={"zero3_save": "checkpoint at save_steps under ZeRO-3: AttributeError:"},
    signatures=(r"AttributeError: '\w+' object has no attribute 'zero_gather_16bit_weights_on_model_save'",
                (r"File \".*transformers[/\\]trainer\.py\", line \d+, in save_model",
                 r"AttributeError: '\w+Config' object has no attribute 'get'")),
    note=("open upstream (trl issues 2885, 2122): gated by the source of save_model in each band of releases. "
          "The PPO trainer's save_model is wrapped: without DeepSpeed it runs upstream's code untouched; with "
          "DeepSpeed it saves the policy with the weights gathered from the engine on every rank (the main "
          "process writes). trl 0.10.x has the same save_model but fails earlier (self.deepspeed is never set, "
          "trl#2025): not covered"),
)
