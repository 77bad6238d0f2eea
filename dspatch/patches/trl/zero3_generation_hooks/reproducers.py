"""Reproducers: a tiny Llama prepared by accelerate at ZeRO-3 (real deepspeed.initialize), generation through
trl's own unwrap_model_for_generation, then training; and a real GRPOTrainer run.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof
from dspatch.patches.trl.zero3_generation_hooks import OLD


def _zero3_config():
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 64},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "gradient_clipping": 1.0}


def _tiny_llama(head="LlamaForCausalLM", seed=0, **extra):
    from dspatch.scenario import tiny_llama

    return tiny_llama(head, seed, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def _prepared():
    """(accelerator, engine) for a fresh tiny Llama at ZeRO-3, through accelerate as trl's trainers do."""
    from accelerate import Accelerator
    from dspatch.scenario import reset_accelerate
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    from dspatch.scenario import init_deepspeed

    init_deepspeed()
    reset_accelerate()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_zero3_config()))
    model = _tiny_llama()
    engine, _ = accelerator.prepare(model, DummyOptim(model.parameters()))
    return accelerator, engine


def _batch(step):
    import torch

    return torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(100 + step))


def _step(accelerator, engine, step):
    loss = engine(input_ids=_batch(step), labels=_batch(step)).loss
    accelerator.backward(loss)  # engine.backward + engine.step under DeepSpeed
    return loss.item()


def _offload(engine):
    return engine.optimizer.parameter_offload


def _hook_state(engine):
    """What ZeRO-3 has on the model: hook counts and the modules hooked (by name), and whether every
    parameter is released (not available, used by no module)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    offload = _offload(engine)
    module = engine.module
    hooked = sorted(name for name, m in module.named_modules()
                    if m._forward_pre_hooks or m._forward_hooks)
    held = sorted(name for name, p in module.named_parameters()
                  if p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.ds_active_sub_modules)
    return {"forward_hooks": len(offload.forward_hooks), "backward_hooks": len(offload.backward_hooks),
            "hooked_modules": hooked, "held_parameters": held}


def _generate(accelerator, engine):
    """What a trainer does to sample: trl's own unwrap_model_for_generation around generate()."""
    import torch
    from trl.models.utils import unwrap_model_for_generation

    prompt = torch.tensor([[1, 5, 9, 13], [1, 7, 11, 17]])
    try:
        with unwrap_model_for_generation(engine, accelerator) as unwrapped:
            out = unwrapped.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                     do_sample=False, pad_token_id=0)
    except AttributeError as e:
        if OLD not in str(e):  # only the bug's own failure counts as the bug
            raise
        raise BugSeen(f"generation under ZeRO-3 failed: AttributeError: {e}") from e
    return out


def _params(engine):
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _run(generate_after):
    """Losses of 4 training steps of a fresh engine, generating after the steps in `generate_after`; the
    hook state after each generation and after the last step; the final parameters."""
    accelerator, engine = _prepared()
    before = _hook_state(engine)
    losses, states = [], []
    for step in range(4):
        losses.append(_step(accelerator, engine, step))
        if step in generate_after:
            _generate(accelerator, engine)
            states.append(_hook_state(engine))
    return before, losses, states, _hook_state(engine), _params(engine)


_warm: list = []


def _warm_up():
    # deepspeed <= 0.16.x: the first engine of a process trains slightly differently from later ones
    # (an upstream fact, seen here on CPU): build one that is never compared
    if not _warm:
        _warm.append(True)
        accelerator, engine = _prepared()
        _step(accelerator, engine, 0)


def generate_then_train():
    """Generation under ZeRO-3 through trl's unwrap_model_for_generation, between training steps: no error,
    the same hooks on the same modules afterwards as before, every parameter released after each step, and
    the same losses and final parameters as the same training with no generation."""
    import torch

    _warm_up()
    _, plain_losses, _, _, plain_params = _run(generate_after=())
    before, losses, states, after, params = _run(generate_after=(0, 2))
    for where, state in [("after generation", s) for s in states] + [("after the last step", after)]:
        if state["forward_hooks"] != before["forward_hooks"] or state["backward_hooks"] != before["backward_hooks"] \
                or state["hooked_modules"] != before["hooked_modules"]:
            raise BugSeen(f"ZeRO-3 hooks {where} differ from before generation: {state} vs {before}")
    if after["held_parameters"]:
        raise BugSeen(f"parameters not released after a step that followed generation: {after['held_parameters']}")
    if losses != plain_losses:
        raise BugSeen(f"losses with generation {losses} differ from those without {plain_losses}")
    changed = [n for n in params if not torch.equal(params[n], plain_params[n])]
    if changed:
        raise BugSeen(f"parameters after training with generation differ from those without: {changed}")


def _tokenizer(folder):
    from dspatch.scenario import word_tokenizer

    words = "the a cat dog sat ran on mat log big small red blue one two three four five six seven".split()
    return word_tokenizer(["<pad>", "<s>", "</s>", "<unk>"] + words, folder, pad_token="<pad>", bos_token="<s>",
                          eos_token="</s>", unk_token="<unk>", padding_side="left")


def _rloo_trainer():
    """trl's RLOOTrainer where it is the PPO-style one (policy, ref_policy, reward_model): trl 0.9-0.2x; its
    keyword for the tokenizer (`tokenizer` before 0.12, `processing_class` after); else None (trl 1.x's RLOO
    is built like GRPO)."""
    import inspect

    try:
        from trl import RLOOConfig, RLOOTrainer
    except ImportError:
        return None
    parameters = inspect.signature(RLOOTrainer.__init__).parameters
    if "policy" not in parameters:
        return None
    return RLOOTrainer, RLOOConfig, "processing_class" if "processing_class" in parameters else "tokenizer"


def rloo_two_steps():
    """A real trl RLOOTrainer run of 2 steps at ZeRO-3, launched as `accelerate launch` with a ZeRO-3
    DeepSpeed config launches it: tiny Llama policy, reference and reward model, tokenizer built in code. RLOO
    generates through unwrap_model_for_generation on the DeepSpeed engine at every step (as PPO, online DPO,
    GKD and trl < 0.15's GRPO do; trl 0.15's GRPOTrainer generates from the bare model, from which trl takes
    no hooks): the run completes, with ZeRO-3's hooks on the policy afterwards. Where trl has no RLOO of that
    shape (trl 1.x), the generation-then-training reproducer runs instead."""
    import json
    import os
    import shutil
    import tempfile

    found = _rloo_trainer()
    if found is None:
        return generate_then_train()
    RLOOTrainer, RLOOConfig, tokenizer_keyword = found
    from accelerate import Accelerator
    from dspatch.scenario import reset_accelerate
    from accelerate.utils import DeepSpeedPlugin
    from datasets import Dataset

    from dspatch.scenario import init_deepspeed

    init_deepspeed()
    reset_accelerate()
    folder = tempfile.mkdtemp(prefix="dspatch-rloo-")
    # no optimizer in the DeepSpeed config: the trainer brings its own
    with open(os.path.join(folder, "ds.json"), "w") as f:
        json.dump({k: v for k, v in _zero3_config().items() if k != "optimizer"}, f)
    launch = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": os.path.join(folder, "ds.json")}
    saved = {k: os.environ.pop(k, None) for k in launch}  # an earlier Accelerator sets them
    try:
        tokenizer = _tokenizer(folder)
        policy, ref_policy = _tiny_llama(), _tiny_llama()
        reward_model = _tiny_llama("LlamaForSequenceClassification", seed=1, num_labels=1)
        prompts = [tokenizer(text)["input_ids"] for text in
                   ("the cat sat on", "a dog ran on", "the big red log", "one two three four")]
        dataset = Dataset.from_dict({"input_ids": prompts})
        args = RLOOConfig(output_dir=folder, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                          num_mini_batches=1, total_episodes=4, local_rollout_forward_batch_size=2, rloo_k=2,
                          num_ppo_epochs=1, response_length=4, learning_rate=1e-2, num_sample_generations=0,
                          report_to=[], save_strategy="no", seed=0, disable_tqdm=True, logging_steps=1)
        # After the config (which makes a plain PartialState of its own): the launch variables and a fresh
        # Accelerator with that DeepSpeed config, whose state the trainer's own Accelerator then shares
        # (accelerate's state is one per process), on every accelerate release.
        os.environ.update(launch)
        reset_accelerate()
        Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=launch["ACCELERATE_DEEPSPEED_CONFIG_FILE"]))
        trainer = RLOOTrainer(config=args, policy=policy, ref_policy=ref_policy, reward_model=reward_model,
                              train_dataset=dataset, **{tokenizer_keyword: tokenizer})
        try:
            trainer.train()
        except AttributeError as e:
            if OLD not in str(e):  # only the bug's own failure counts as the bug
                raise
            raise BugSeen(f"RLOOTrainer at ZeRO-3 failed at its first generation: AttributeError: {e}") from e
        # 2 updates of args.batch_size (2) episodes each (global_step counts twice per update in trl 0.11)
        if trainer.state.episode != args.total_episodes:
            raise BugSeen(f"RLOOTrainer stopped after {trainer.state.episode} of {args.total_episodes} episodes")
        offload = _offload(trainer.model)
        if not offload.forward_hooks or not offload.backward_hooks:
            raise BugSeen("RLOOTrainer's policy has no ZeRO-3 hooks after training")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_accelerate()
        shutil.rmtree(folder, ignore_errors=True)


PROOF = Proof(
    scenarios={"generate_then_train": generate_then_train, "rloo_two_steps": rloo_two_steps},
    expected_on_stock={
      "generate_then_train": ("generation under ZeRO-3 failed: AttributeError: 'DeepSpeedZeRoOffload' object "
                              "has no attribute '_register_hooks_recursively'"),
      "rloo_two_steps": ("RLOOTrainer at ZeRO-3 failed at its first generation: AttributeError: "
                         "'DeepSpeedZeRoOffload' object has no attribute '_register_hooks_recursively'")},
    # The releases of trl that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.7.0", "0.17.0"),
    # A version of each package the patch `requires` with the bug's need, and one without (release suite).
    others_with_and_without=({"deepspeed": "0.16.9"}, {"deepspeed": "0.16.3"}),
)
