"""Reproducers: real trl PPO training (2 steps) on CPU under accelerate + DeepSpeed, tiny Llama policy / reference /
reward / value models built from configs, a tokenizer built in code, then save and reload.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import os

from dspatch.spec import BugSeen, Proof


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
    from dspatch.scenario import word_tokenizer

    return word_tokenizer(["<pad>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)], pad_token="<pad>",
                          eos_token="<eos>", unk_token="<pad>", padding_side="left")


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
    from dspatch.scenario import reset_accelerate

    reset_accelerate()


def _past_generation_hooks_bug():
    """Whether ZeRO-3 generation would first hit another bug here (trl <= 0.15.2 with deepspeed >= 0.16.4:
    dspatch's trl/zero3-generation-hooks) which is not being fixed in this process. The reproducers then
    generate without gathering (`ds3_gather_for_generation=False`, which trl has since 0.13), so that they show
    this bug and nothing else."""
    from dspatch import gating, registry
    from dspatch.scenario import applied

    other = registry.all_patches().get("trl/zero3-generation-hooks")
    return other is not None and not applied(other.id) and gating.evaluate(other).verdict == gating.APPLIES


def gathered_policy(module):
    """{name: full tensor} of the policy inside PolicyAndValueWrapper `module` (a collective at ZeRO-3)."""
    from dspatch.scenario import gathered_whole

    return gathered_whole(module.policy.named_parameters())


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


PROOF = Proof(
    scenarios={"zero3_save": zero3_save, "zero2_save": zero2_save},
    expected_on_stock={"zero3_save": "checkpoint at save_steps under ZeRO-3: AttributeError:"},
    # The releases of trl that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.9.0", "1.16.0"),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("trl_tf5",),
)
