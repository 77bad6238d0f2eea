"""Reproducers: peft LoRA with `modules_to_save` at ZeRO-3 on the CPU, through transformers' Trainer and through a
plain deepspeed.initialize; each against the same training with the wrapped module trained directly (no
ModulesToSaveWrapper: what the wrapper's copy must become), losses and trained weights compared bit for bit.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.patches.deepspeed.zero3_modules_to_save_grads import MISSING
from dspatch.scenario import on_accelerator
from dspatch.spec import BugSeen, Proof

STEPS = 2


def _ds_config(auto):
    lr = "auto" if auto else 1e-2
    config = {"train_micro_batch_size_per_gpu": "auto" if auto else 2, "steps_per_print": 10**6,
              "gradient_accumulation_steps": "auto" if auto else 1,
              "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0}}
    return config


def _lora(model, head, wrapped, seq_cls=False):
    """LoRA on q/v with `head` trained too: through peft's modules_to_save (its ModulesToSaveWrapper copy; for a
    SEQ_CLS model peft adds the head itself) when `wrapped`, else left in place and made trainable after
    get_peft_model froze it."""
    from peft import LoraConfig, get_peft_model

    if wrapped:
        extra = {"task_type": "SEQ_CLS"} if seq_cls else {"modules_to_save": [head]}
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra))
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in lora.named_parameters():
        if f".{head}." in name:
            param.requires_grad_(True)
    return lora


def _trained(model):
    """{name as without the wrapper: weight} of the trainable parameters (the wrapper's copy named as the module)."""
    import deepspeed

    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in trained]):
        return {n.replace(".modules_to_save.default", ""): p.detach().clone() for n, p in trained}


def _missing(e):
    if MISSING not in str(e):  # only the bug's own failure counts as the bug
        raise e
    return BugSeen(f"first step at ZeRO-3: AttributeError: {e}")


def _compare(wrapped, direct, what):
    import torch

    (losses, weights), (want_losses, want_weights) = wrapped, direct
    if losses != want_losses:
        raise AssertionError(f"{what}: losses {losses} differ from training the module directly {want_losses}")
    if set(weights) != set(want_weights):
        raise AssertionError(f"{what}: trained {sorted(weights)} against {sorted(want_weights)}")
    changed = [n for n in weights if not torch.equal(weights[n], want_weights[n])]
    if changed:
        raise AssertionError(f"{what}: trained weights differ from training the module directly: {changed}")


def trainer_run(wrapped):
    """(losses, trained weights) of a Trainer run: tiny Llama, LoRA, lm_head trained through modules_to_save
    (`wrapped`) or directly; ZeRO-3, no gradient clipping (the same update whatever order the norm is summed in)."""
    import tempfile

    from dspatch.scenario import init_deepspeed, lm_rows, reset_accelerate, tiny_llama, train_with_deepspeed

    init_deepspeed()
    from transformers import Trainer, TrainingArguments

    reset_accelerate()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to=[], deepspeed=_ds_config(True),
                                 max_grad_norm=0.0, lr_scheduler_type="constant", dataloader_num_workers=0, seed=0,
                                 data_seed=0)
        model = _lora(tiny_llama(), "lm_head", wrapped)
        trainer = Trainer(model=model, args=args, train_dataset=lm_rows(STEPS * 2, 16))
        train_with_deepspeed(trainer, AttributeError, _missing)
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], _trained(model)


def trainer_lm_head():
    """Trainer + LoRA with modules_to_save=["lm_head"] at ZeRO-3: trains 2 steps, and the trained lm_head copy (with
    the LoRA weights and the losses) equals, bit for bit, the same run with lm_head trained directly."""
    _compare(trainer_run(True), trainer_run(False), "Trainer, modules_to_save=['lm_head']")


def initialize_run(wrapped):
    """(losses, trained weights) of a plain deepspeed.initialize run of a SEQ_CLS LoRA model (peft wraps the `score`
    head itself), or the same model with `score` trained directly."""
    import torch

    from dspatch.scenario import init_deepspeed, tiny_llama

    deepspeed = init_deepspeed()
    model = tiny_llama("LlamaForSequenceClassification", num_labels=3, pad_token_id=0)
    model = _lora(model, "score", wrapped, seq_cls=True)
    wrappers = [n for n, m in model.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"]
    if bool(wrappers) != wrapped:
        raise AssertionError(f"peft's SEQ_CLS head wrappers: {wrappers}")
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(False),
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    generator = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        ids = on_accelerator(torch.randint(4, 64, (2, 12), generator=generator))
        labels = on_accelerator(torch.randint(0, 3, (2,), generator=generator))
        try:  # stock fails in the first forward already (the head's reused function counts on the child)
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
        except AttributeError as e:
            raise _missing(e) from e
        engine.step()
        losses.append(loss.item())
    return losses, _trained(engine.module)


_warm: list = []


def seq_cls_head():
    """A SEQ_CLS LoRA model (peft adds its classifier head to modules_to_save) through deepspeed.initialize at
    ZeRO-3: trains 2 steps, and equals, bit for bit, the same model with its head trained directly."""
    if not _warm:  # deepspeed <= 0.16.x: the first engine of a process trains slightly differently
        _warm.append(initialize_run(False))
    _compare(initialize_run(True), initialize_run(False), "deepspeed.initialize, SEQ_CLS head")


PROOF = Proof(
    scenarios={"trainer_lm_head": trainer_lm_head, "seq_cls_head": seq_cls_head},
    expected_on_stock={"trainer_lm_head": f"first step at ZeRO-3: AttributeError: 'Linear' {MISSING}",
                       "seq_cls_head": f"first step at ZeRO-3: AttributeError: 'Linear' {MISSING}"},
    band_check="seq_cls_head",
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
)
