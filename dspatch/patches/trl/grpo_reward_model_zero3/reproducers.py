"""Reproducers: a real GRPOTrainer (trl's own generation, CPU, bf16 off) at ZeRO-3 on a tiny Llama policy saved to a
folder (trl < 0.17 loads its reference model from there under ZeRO-3), with a tiny Llama reward model given as a
reward function, created by from_pretrained while the ZeRO-3 config is live (so under deepspeed.zero.Init, as a
user's is). Two GRPO steps; the rewards the trainer computed are compared with the same reward model, gathered
after training, evaluated without DeepSpeed on the same inputs.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.patches.trl.grpo_reward_model_zero3 import PARTITIONED
from dspatch.spec import BugSeen, Proof

WORDS = "the a cat dog sat ran on mat log big small red blue one two three four five six seven".split()


def _folders(root):
    """A tiny Llama policy and a tiny Llama reward model (one label), each saved with a tokenizer made in code."""
    import os

    from dspatch.scenario import tiny_llama, word_tokenizer

    special = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>", padding_side="left",
                   model_input_names=["input_ids", "attention_mask"])
    vocab = ["<pad>", "<s>", "</s>", "<unk>"] + WORDS
    folders = {}
    for name, head, extra in (("policy", "LlamaForCausalLM", {}),
                              ("reward", "LlamaForSequenceClassification", {"num_labels": 1})):
        folder = os.path.join(root, name)
        model = tiny_llama(head, seed=len(name), pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
        model.save_pretrained(folder)
        word_tokenizer(vocab, folder, **special)
        folders[name] = folder
    return folders


def grpo_with_reward_model():
    """GRPOTrainer, ZeRO-3, a reward model under zero.Init as a reward function: 2 steps train; the rewards are
    finite, not all zero, and equal the reward model's own output on the same completions without DeepSpeed."""
    import tempfile

    import torch

    from dspatch.scenario import init_deepspeed, reset_accelerate

    init_deepspeed()
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    reset_accelerate()
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 10**6,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0},
          "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}}}
    with tempfile.TemporaryDirectory() as root:
        folders = _folders(root)
        args = GRPOConfig(output_dir=f"{root}/out", per_device_train_batch_size=2, num_generations=2, max_steps=2,
                          max_prompt_length=8, max_completion_length=4, learning_rate=1e-2, logging_steps=1,
                          save_strategy="no", report_to=[], bf16=False, deepspeed=ds, seed=0, temperature=1.0,
                          dataloader_num_workers=0)
        reward = AutoModelForSequenceClassification.from_pretrained(folders["reward"], num_labels=1)  # zero.Init
        if not hasattr(next(reward.parameters()), "ds_id"):
            raise AssertionError("the reward model was not created under deepspeed.zero.Init")
        seen = []
        reward.register_forward_hook(lambda module, args, kwargs, out: seen.append(
            (kwargs["input_ids"].clone(), kwargs["attention_mask"].clone(), out.logits[:, 0].detach().clone())),
            with_kwargs=True)
        prompts = Dataset.from_dict({"prompt": ["the cat sat on", "a dog ran on", "one two three", "big red log"]})
        tokenizer = AutoTokenizer.from_pretrained(folders["policy"])
        trainer = GRPOTrainer(model=folders["policy"], reward_funcs=[reward], args=args, train_dataset=prompts,
                              processing_class=tokenizer, reward_processing_classes=[tokenizer])
        try:
            trainer.train()
        except RuntimeError as e:
            if not any(message in str(e) for message in PARTITIONED):
                raise
            raise BugSeen(f"GRPO's first reward computation under ZeRO-3: RuntimeError: {e}") from e
        finally:
            reset_accelerate()
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(reward.parameters())):
            weights = {n: p.detach().clone() for n, p in reward.named_parameters()}
    if len(seen) < 2:
        raise AssertionError(f"the reward model ran {len(seen)} times in 2 GRPO steps")
    rewards = torch.cat([logits for _, _, logits in seen])
    if not torch.isfinite(rewards).all() or not rewards.abs().sum():
        raise AssertionError(f"rewards {rewards.tolist()}")
    from transformers import LlamaForSequenceClassification

    plain = LlamaForSequenceClassification(reward.config)
    plain.load_state_dict(weights, strict=False)
    missing = set(dict(plain.named_parameters())) - set(weights)
    if missing:
        raise AssertionError(f"weights missing from the gathered reward model: {sorted(missing)}")
    plain.eval()
    with torch.no_grad():
        again = torch.cat([plain(input_ids=ids, attention_mask=mask).logits[:, 0] for ids, mask, _ in seen])
    if not torch.allclose(rewards, again, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"rewards under GRPO {rewards.tolist()} differ from the model's own {again.tolist()}")


PROOF = Proof(
    scenarios={"grpo_with_reward_model": grpo_with_reward_model},
    expected_on_stock={"grpo_with_reward_model": "GRPO's first reward computation under ZeRO-3: RuntimeError:"},
    # The releases of trl that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.13.0", "0.17.0"),
)
