"""The recipes users run, one cell at a time: `python tests/recipes.py RECIPE STAGE` runs RECIPE (the Trainer, trl's
trainers, a custom accelerate loop) at ZeRO STAGE for two steps on a tiny Llama, 1 CPU rank, and prints one line
`R {json}`: {"status": "ok" or "ExceptionType: message", "losses": the logged losses, "weights": a sha256 of the
weights after training (gathered), "extra": what the recipe measures besides}. tests/test_no_harm_trainer.py and tests/test_no_harm_trl.py run every cell
stock and with DSPATCH=1 and compares.

Each recipe adapts to the trl of the stack where its API moved (0.11's `tokenizer=` and config names); a recipe a
stack's trl does not have raises Unavailable (the cell is skipped, with the reason).
"""
import hashlib
import json
import os
import sys
import tempfile

WORDS = "the a cat dog sat ran on mat log big small red blue one two three four five six seven".split()
PROMPTS = ["the cat sat", "a dog ran", "one two three", "big red log"]
GOOD = [" on the mat", " on a log", " four five", " is small"]
BAD = [" blue", " seven six", " red red", " the the"]


class Unavailable(Exception):
    """This stack's packages do not have the recipe."""


def ds_config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "steps_per_print": 10**6, "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"}, "zero_optimization": zero}


def version(name):
    from importlib.metadata import version as v

    from packaging.version import Version

    try:
        return Version(v(name))
    except Exception:
        return None


def tokenizer():
    from dspatch.scenario import word_tokenizer

    tok = word_tokenizer(["<pad>", "<s>", "</s>", "<unk>"] + WORDS, pad_token="<pad>", bos_token="<s>",
                         eos_token="</s>", unk_token="<unk>", model_input_names=["input_ids", "attention_mask"])
    tok.chat_template = None
    return tok


def model(head="LlamaForCausalLM", **extra):
    from dspatch.scenario import tiny_llama

    return tiny_llama(head, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def common(out, stage, **extra):
    """TrainingArguments' fields every recipe shares."""
    return dict(output_dir=out, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2, logging_steps=1,
                save_strategy="no", report_to=[], bf16=False, seed=0, data_seed=0, dataloader_num_workers=0,
                disable_tqdm=True,
                deepspeed=ds_config(stage), **extra)


def digest(named):
    from dspatch.scenario import gathered_whole

    h = hashlib.sha256()
    for name, tensor in sorted(gathered_whole(named).items()):
        h.update(name.encode())
        h.update(tensor.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def result(trainer, **extra):
    return {"losses": losses(trainer), "weights": digest(trainer.model.named_parameters()), "extra": extra}


def lm_data():
    from dspatch.scenario import lm_rows

    return lm_rows(8, 10, seed=3)


def saved(out, head="LlamaForCausalLM", **extra):
    """A tiny model saved with its tokenizer, as a path: trl loads the reference model from it by name."""
    folder = os.path.join(out, head)
    model(head, **extra).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def trl_run(kind, stage, out, rows, model_obj, config_extra=None, **kw):
    """Train a trl trainer of `kind` ("DPO", "KTO", "SFT", "Reward", "GRPO") as this stack's trl takes it."""
    import trl
    from datasets import Dataset

    if not hasattr(trl, f"{kind}Trainer"):
        raise Unavailable(f"trl {trl.__version__} has no {kind}Trainer")
    config = getattr(trl, f"{kind}Config")
    fields = set(getattr(config, "__dataclass_fields__", {}))
    args = {k: v for k, v in common(out, stage, **(config_extra or {})).items()}
    for name in ("max_length", "max_prompt_length", "max_completion_length"):
        if name in fields and name not in args and kind not in ("GRPO",):
            args[name] = 32 if name == "max_length" else 16
    if kind in ("DPO", "KTO") and "precompute_ref_log_probs" in args and "precompute_ref_log_probs" not in fields:
        raise Unavailable(f"trl {trl.__version__}'s {kind}Config has no precompute_ref_log_probs")
    args = {k: v for k, v in args.items() if k in fields or k in ("output_dir",)}
    tok_kw = {"processing_class": tokenizer()} if version("trl") >= version_of("0.12") else {"tokenizer": tokenizer()}
    if kind == "GRPO":
        tok_kw = {"processing_class": tokenizer()}
    trainer = getattr(trl, f"{kind}Trainer")(model=model_obj, args=config(**args),
                                             train_dataset=Dataset.from_dict(rows), **tok_kw, **kw)
    trainer.train()
    return result(trainer)


def version_of(text):
    from packaging.version import Version

    return Version(text)


def preference_rows():
    return {"prompt": PROMPTS, "chosen": GOOD, "rejected": BAD}


# ---- the recipes: each (stage, folder) -> result dict ---------------------------------------------------------------

def trainer(stage, out, before=(), twice=False, after=()):
    from transformers import Trainer, TrainingArguments

    t = Trainer(model=model(), args=TrainingArguments(**common(out, stage, per_device_eval_batch_size=4)),
                train_dataset=lm_data(), eval_dataset=lm_data())
    extra = {}
    for step in before:
        extra[step] = getattr(t, step)(*([lm_data()] if step == "predict" else []))
        extra[step] = extra[step]["eval_loss"] if step == "evaluate" else None
    t.train()
    if twice:
        extra["first"] = losses(t)
        t.train()
    for step in after:
        value = getattr(t, step)(*([lm_data()] if step == "predict" else []))
        extra[step] = value["eval_loss"] if step == "evaluate" else float(value.metrics["test_loss"])
    return result(t, **extra)


def trainer_resume(stage, out):
    from transformers import Trainer, TrainingArguments

    from dspatch.scenario import reset_accelerate

    first = Trainer(model=model(), args=TrainingArguments(**{**common(out, stage), "save_strategy": "steps",
                                                              "save_steps": 1, "max_steps": 1}),
                    train_dataset=lm_data())
    first.train()
    reset_accelerate()
    t = Trainer(model=model(), args=TrainingArguments(**{**common(out, stage), "save_strategy": "steps",
                                                          "save_steps": 1}), train_dataset=lm_data())
    t.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    return result(t)


def sft(stage, out):
    rows = {"text": [p + g for p, g in zip(PROMPTS, GOOD)]}
    extra = {"dataset_text_field": "text", "packing": False}
    return trl_run("SFT", stage, out, rows, saved(out), config_extra=extra)


def dpo(stage, out, ref=False, lora=False, precompute=0):
    extra = {}
    if precompute:
        extra.update(precompute_ref_log_probs=True, precompute_ref_batch_size=len(PROMPTS) // precompute)
    kw = {}
    if ref:
        kw["ref_model"] = model(seed=1)
    if lora:
        import peft

        kw["peft_config"] = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return trl_run("DPO", stage, out, preference_rows(), saved(out), config_extra=extra, **kw)


def kto(stage, out, precompute=0):
    rows = {"prompt": PROMPTS, "completion": GOOD, "label": [True, False, True, False]}
    extra = {"precompute_ref_log_probs": True, "precompute_ref_batch_size": 2} if precompute else {}
    return trl_run("KTO", stage, out, rows, saved(out), config_extra=extra)


def reward(stage, out):
    rows = preference_rows()
    rows = {"chosen": [p + g for p, g in zip(PROMPTS, GOOD)], "rejected": [p + b for p, b in zip(PROMPTS, BAD)]}
    import trl

    if version("trl") < version_of("0.12"):  # 0.11 wants tokenized pairs
        tok = tokenizer()
        enc = lambda texts: tok(texts)  # noqa: E731
        c, r = enc(rows["chosen"]), enc(rows["rejected"])
        rows = {"input_ids_chosen": c["input_ids"], "attention_mask_chosen": c["attention_mask"],
                "input_ids_rejected": r["input_ids"], "attention_mask_rejected": r["attention_mask"]}
    del trl
    # a model object: trl 0.11's RewardTrainer takes no name
    return trl_run("Reward", stage, out, rows, model("LlamaForSequenceClassification", num_labels=1))


def grpo(stage, out, reward_model=False):
    import trl

    if not hasattr(trl, "GRPOTrainer"):
        raise Unavailable(f"trl {trl.__version__} has no GRPOTrainer")
    if reward_model:
        if version("trl") < version_of("1.0"):
            raise Unavailable(f"trl {trl.__version__} takes a reward model object only (trl/grpo-reward-model-zero3's "
                              f"reproducers run that recipe on it)")
        funcs = [saved(out, "LlamaForSequenceClassification", num_labels=1)]
    else:
        funcs = [lambda completions, **_: [float(len(c)) for c in completions]]
    extra = {"num_generations": 2, "max_completion_length": 4, "temperature": 1.0}
    return trl_run("GRPO", stage, out, {"prompt": PROMPTS}, saved(out), config_extra=extra, reward_funcs=funcs,
                   **({"reward_processing_classes": [tokenizer()]} if reward_model else {}))


def accelerate_loop(stage, out):
    """A custom loop: accelerate with DeepSpeed, gradient accumulation 2, save_state after the first step and
    load_state before the second."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    config = {**ds_config(stage), "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "gradient_clipping": 1.0}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=2)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    rows = lm_data()
    loader = torch.utils.data.DataLoader([{k: torch.tensor(v) for k, v in r.items()} for r in rows], batch_size=2)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    seen = []
    for i, batch in enumerate(loader):
        with accelerator.accumulate(net):
            loss = net(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seen.append(loss.item())
        if i == 1:
            accelerator.save_state(os.path.join(out, "state"))
            accelerator.load_state(os.path.join(out, "state"))
    return {"losses": seen, "weights": digest(accelerator.unwrap_model(net).named_parameters()), "extra": {}}


RECIPES = {
    "trainer": lambda s, o: trainer(s, o),
    "trainer_eval_predict": lambda s, o: trainer(s, o, after=("evaluate", "predict")),
    "trainer_evaluate_first": lambda s, o: trainer(s, o, before=("evaluate",)),
    "trainer_twice": lambda s, o: trainer(s, o, twice=True),
    "trainer_resume": trainer_resume,
    "sft": sft,
    "dpo_ref_model": lambda s, o: dpo(s, o, ref=True),
    "dpo": dpo,
    "dpo_lora": lambda s, o: dpo(s, o, lora=True),
    "dpo_precompute_1": lambda s, o: dpo(s, o, precompute=1),
    "dpo_precompute_2": lambda s, o: dpo(s, o, precompute=2),
    "dpo_lora_precompute": lambda s, o: dpo(s, o, lora=True, precompute=1),
    "kto": kto,
    "kto_precompute": lambda s, o: kto(s, o, precompute=1),
    "grpo_reward_function": grpo,
    "grpo_reward_model": lambda s, o: grpo(s, o, reward_model=True),
    "reward": reward,
    "accelerate_loop": accelerate_loop,
}


def main(argv):
    name, stage = argv[0], int(argv[1])
    from dspatch.scenario import init_deepspeed, reset_accelerate, settle

    os.environ.setdefault("TQDM_DISABLE", "1")
    init_deepspeed()
    reset_accelerate()
    settle()  # ZeRO-3's set-up collects garbage a dozen times per engine: what is imported out of its sight
    with tempfile.TemporaryDirectory(prefix="dspatch-recipe-") as out:
        try:
            found = {"status": "ok", **RECIPES[name](stage, out)}
        except Unavailable as e:
            found = {"status": "unavailable", "why": str(e)}
        except Exception as e:  # the cell's outcome, compared by the test
            import traceback

            traceback.print_exc()
            found = {"status": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    print("R " + json.dumps(found, default=float), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
