"""Reproducers: the real Trainer on a tiny Llama (hidden 32, 2 layers) with LoRA on q_proj/v_proj (8 adapter
tensors), 2 steps at ZeRO-3 on the CPU, then checkpoint-2 and save_model. Every rank of a torchrun job runs
them the same way (the checks read the shared folders after a barrier).

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof


LORA_TENSORS = 8


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _cleanup(folder):
    import shutil

    dist = _dist()
    if dist is None or dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _shared_tmpdir():
    """One fresh folder, the same on every rank."""
    import tempfile

    from dspatch.scenario import init_deepspeed

    init_deepspeed()  # torch.distributed is up (under torchrun: both ranks) before the folder is shared
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return tempfile.mkdtemp(prefix="dspatch-peft-")
    folder = [tempfile.mkdtemp(prefix="dspatch-peft-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def _base_model():
    from dspatch.scenario import tiny_llama

    return tiny_llama()


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))


class _Recorder:
    """Names of the partitioned parameters DeepSpeed gathers (every gather goes through each ZeRO-3 parameter's
    own all_gather / all_gather_coalesced; parameters ZeRO-3 keeps whole, `ds_persist`, do not count), and the
    calls of Trainer._save on this rank; observation only."""

    def __init__(self, trainer):
        self.trainer, self.gathered, self.saves, self._undo = trainer, [], 0, []

    def __enter__(self):
        names = {id(p): n for n, p in self.trainer.deepspeed.module.named_parameters()}
        for param in self.trainer.deepspeed.module.parameters():
            for attr in ("all_gather", "all_gather_coalesced"):
                original = param.__dict__.get(attr)
                if original is None:
                    continue

                def record(param_list=None, *args, _original=original, _param=param, **kwargs):
                    for p in (param_list if param_list is not None else [_param]):
                        if not getattr(p, "ds_persist", False):  # persistent ones are whole on every rank anyway
                            self.gathered.append(names.get(id(p), "?"))
                    return _original(param_list, *args, **kwargs)

                setattr(param, attr, record)
                self._undo.append((param, attr, original))
        save = self.trainer._save

        def recording_save(*args, **kwargs):
            self.saves += 1
            return save(*args, **kwargs)

        self.trainer._save = recording_save
        return self

    def __exit__(self, *exc):
        for param, attr, original in self._undo:
            setattr(param, attr, original)
        del self.trainer._save


def _train(folder, peft=True, gather=False, persistence=0, save_steps=2):
    """A Trainer trained 2 steps (checkpoint-2 written when save_steps=2), returned with its records."""
    import torch
    from dspatch.scenario import reset_accelerate
    from transformers import Trainer, TrainingArguments

    from dspatch.scenario import init_deepspeed

    init_deepspeed()
    reset_accelerate()
    model = _base_model()
    if peft:
        model = _lora(model)
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "steps_per_print": 10**6,
                 # DeepSpeed builds the optimizer (and the Trainer's scheduler on it): the Trainer's own AdamW
                 # has an empty no-decay group for LoRA, which trips another bug (accelerate/deepspeed-scheduler-
                 # param-groups) on torch >= 2.10
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                           "torch_adam": True}},
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence,
                                       "stage3_prefetch_bucket_size": 64,
                                       "stage3_gather_16bit_weights_on_model_save": gather}}
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=2, max_steps=2, learning_rate=5e-2,
                             report_to=[], logging_strategy="no", save_strategy="steps", save_steps=save_steps,
                             deepspeed=ds_config, seed=0, disable_tqdm=True)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 8), generator=generator)]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.numel()}
    trainer.train()
    return trainer, initial


def _reference(trainer):
    """The trained adapter: its parameters gathered from the ZeRO-3 partitions (every rank takes part), with
    PEFT's file names (no adapter name)."""
    from dspatch.scenario import gathered_whole

    trainer.deepspeed.empty_partition_cache()  # a parameter left gathered, or in flight, is read from the partitions
    named = [(n, p) for n, p in trainer.deepspeed.module.named_parameters() if p.requires_grad]
    return {n.replace(".default.", "."): p for n, p in gathered_whole(named).items()}


def _barrier():
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def _check_adapter(folder, where, reference):
    import os

    import torch
    from safetensors.torch import load_file

    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise AssertionError(f"{where}: no adapter_model.safetensors in {sorted(os.listdir(folder))}")
    saved = load_file(path)
    wanted = {k: v for k, v in reference.items() if "lora_" in k}
    if len(wanted) != LORA_TENSORS:
        raise AssertionError(f"the model has {len(wanted)} LoRA tensors, not {LORA_TENSORS}")
    found = [k for k in wanted if k in saved]
    if len(found) != len(wanted):
        raise BugSeen(f"{where}: adapter_model.safetensors holds {len(found)} of {len(wanted)} trained tensors "
                      f"({os.path.getsize(path)} bytes)")
    differ = [k for k in wanted if not torch.equal(saved[k], wanted[k])]
    if differ or set(saved) != set(wanted):
        raise BugSeen(f"{where}: the saved adapter is not the trained one: differs in {differ}, "
                      f"extra {sorted(set(saved) - set(wanted))}")


def _check_loads(folder, reference):
    import torch
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(_base_model(), folder)
    got = {n.replace(".default.", "."): p for n, p in loaded.named_parameters() if "lora_" in n}
    differ = [k for k, v in reference.items() if "lora_" in k and not torch.equal(got.get(k, torch.empty(0)), v)]
    if differ:
        raise BugSeen(f"PeftModel.from_pretrained(base, folder) does not give the trained adapter: {differ}")


def _files(folder):
    import os

    return sorted(os.listdir(folder))


def _check_files(folder, where, deepspeed_checkpoint, peft=True):
    """The files of a save_model/checkpoint folder as transformers 5.x writes them: the adapter (or the model
    config), training_args.bin, DeepSpeed's checkpoint exactly where asked; never the dummy weight files."""
    files = _files(folder)
    ds_files = [f for f in files if f.startswith("global_step") or f in ("latest", "zero_to_fp32.py")]
    wanted = ["adapter_config.json", "adapter_model.safetensors"] if peft else ["config.json"]
    missing = [f for f in wanted + ["training_args.bin"] if f not in files]
    dummies = [f for f in files if f in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")]
    problems = []
    if missing or dummies:
        problems.append(f"missing {missing}, dummy weight files {dummies}")
    if deepspeed_checkpoint and not (any(f.startswith("global_step") for f in ds_files) and "latest" in ds_files):
        problems.append(f"no DeepSpeed checkpoint (global_step*/, latest): {files}")
    if not deepspeed_checkpoint and ds_files:
        problems.append(f"DeepSpeed's full checkpoint written where the adapter was saved: {ds_files}")
    if problems:
        raise AssertionError(f"{where}: {'; '.join(problems)} (files: {files})")


def _in_shared_folder(body):
    """Run body(folder) in a fresh folder shared by the ranks, removed afterwards by rank 0."""
    folder = _shared_tmpdir()
    try:
        body(folder)
    finally:
        # every rank reaches this (its checks raise only after the last collective): nobody removes the folder
        # while another rank reads it, and a rank whose checks failed does not leave the other one waiting
        _barrier()
        _cleanup(folder)


def _peft_save(folder, persistence):
    import os

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    trainer, initial = _train(folder, persistence=persistence)
    reference = _reference(trainer)
    unchanged = [k for k, v in initial.items() if k.replace(".default.", ".") in reference
                 and "lora_B" in k and bool((reference[k.replace(".default.", ".")] == v).all())]
    if unchanged:
        raise AssertionError(f"training did not change the adapter: {unchanged}")
    final = os.path.join(folder, "final")
    with _Recorder(trainer) as record:
        trainer.save_model(final)
    unset_hf_deepspeed_config()
    _barrier()
    rank = _dist().get_rank() if _dist() else 0
    if record.saves != (1 if trainer.args.should_save else 0):
        raise AssertionError(f"rank {rank} (should_save={trainer.args.should_save}) called _save {record.saves} times")
    _check_adapter(os.path.join(folder, "checkpoint-2"), "checkpoint-2", reference)
    _check_adapter(final, "save_model", reference)
    _check_loads(final, reference)
    _check_files(os.path.join(folder, "checkpoint-2"), "checkpoint-2", deepspeed_checkpoint=True)
    _check_files(final, "save_model", deepspeed_checkpoint=False)
    # last, so that a run past every check above shows this one: transformers >= 5.0 (upstream's fix) saves the
    # right adapter but gathers each frozen weight whole on the way (DeepSpeed's consolidation)
    frozen = sorted({n for n in record.gathered if n not in {k for k, p in trainer.deepspeed.module.named_parameters()
                                                            if p.requires_grad}})
    if frozen:
        raise AssertionError(f"save_model gathered frozen base weights whole: {frozen[:3]}... ({len(frozen)})")


def peft_save_partitioned():
    """LoRA parameters partitioned (stage3_param_persistence_threshold 0), the gather flag off: checkpoint-2 and
    save_model write the trained adapter exactly, it loads with PeftModel.from_pretrained, only the saving rank
    writes, frozen weights are never gathered, and no DeepSpeed checkpoint lands in the save_model folder."""
    _in_shared_folder(lambda folder: _peft_save(folder, persistence=0))


def peft_save_persistent():
    """The same with ZeRO-3 keeping the small LoRA parameters whole on every rank (persistence threshold 200,
    the base weights partitioned), as its default threshold does for LoRA on real models."""
    _in_shared_folder(lambda folder: _peft_save(folder, persistence=200))


def _peft_gather_flag_on(folder):
    import os

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    trainer, _ = _train(folder, gather=True, save_steps=100)
    reference = _reference(trainer)
    final = os.path.join(folder, "final")
    with _Recorder(trainer) as record:
        trainer.save_model(final)
    unset_hf_deepspeed_config()
    _barrier()
    frozen = [n for n, p in trainer.deepspeed.module.named_parameters() if not p.requires_grad]
    if not set(frozen) <= set(record.gathered):
        raise AssertionError("with the gather flag on, save_model no longer gathers the whole model (stock does)")
    _check_adapter(final, "save_model", reference)
    _check_files(final, "save_model", deepspeed_checkpoint=False)


def peft_gather_flag_on():
    """With stage3_gather_16bit_weights_on_model_save true, stock's path: accelerate gathers the whole model
    (frozen weights too) and the adapter is right; unchanged by the patch."""
    _in_shared_folder(_peft_gather_flag_on)


def _no_peft_unchanged(folder):
    import os

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    trainer, _ = _train(folder, peft=False, save_steps=100)
    final = os.path.join(folder, "final")
    with _Recorder(trainer) as record:
        trainer.save_model(final)
    unset_hf_deepspeed_config()
    _barrier()
    if record.gathered:
        raise AssertionError(f"save_model gathered parameters of a plain model without the flag: {record.gathered[:4]}")
    _check_files(final, "save_model", deepspeed_checkpoint=True, peft=False)


def no_peft_unchanged():
    """A plain model at ZeRO-3 with the gather flag off: stock's fallback, DeepSpeed's full checkpoint in the
    save_model folder, no weight file, nothing gathered."""
    _in_shared_folder(_no_peft_unchanged)


PROOF = Proof(
    scenarios={"peft_save_partitioned": peft_save_partitioned, "peft_save_persistent": peft_save_persistent,
               "peft_gather_flag_on": peft_gather_flag_on, "no_peft_unchanged": no_peft_unchanged},
    expected_on_stock={
      "peft_save_partitioned": "checkpoint-2: adapter_model.safetensors holds 0 of 8 trained tensors (40 bytes)",
      "peft_save_persistent": "checkpoint-2: adapter_model.safetensors holds 0 of 8 trained tensors (40 bytes)"},
    # The releases of transformers that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("4.44.0", "5.0.0"),
)
