"""A PEFT model trained with ZeRO-3 saves its adapter, not an empty 40-byte file (transformers 4.44.0-4.57.6).

With the Trainer, DeepSpeed ZeRO-3 and a PEFT model (LoRA...), and `stage3_gather_16bit_weights_on_model_save` left at
its default (false), `trainer.save_model(dir)` and every periodic `checkpoint-N` write an `adapter_model.safetensors`
with no tensor in it (40 bytes), with no error: the trained adapter is lost. Why: `Trainer.save_model` asks accelerate's
`get_state_dict` for the weights; at ZeRO-3 without that flag it raises `ValueError`; the Trainer logs "
stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead", calls `_save(dir, state_dict={})`
and writes DeepSpeed's full checkpoint into `dir`. PEFT's `save_pretrained` uses its own state dict only when given
None, so it filters the empty dict and writes an empty adapter. Upstream fixed it in transformers 5.0.0 (PR 41416): for
PEFT at ZeRO-3 the Trainer takes the state dict from DeepSpeed itself
(`_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)`). Related upstream threads: trl issue 4416, peft
issue 2892, DeepSpeed PR 7900.

Every release 4.44.0-4.57.6 has the same DeepSpeed branch in `Trainer.save_model` (checked from the sdists). The patch
changes one expression of that function: where it asked accelerate for the state dict, it asks
`state_dict_for_save(self)` below, which
- for a PEFT model at ZeRO-3 with the gather flag off (the case that lost the adapter) gathers the trainable parameters
  only, one module at a time: a collective that every rank runs, in the same order; the copy is kept on the ranks that
  save (`args.should_save`, so also each node's main process with `save_on_each_node`), and only they write, through the
  Trainer's own `_save`. Frozen (base) weights are never gathered whole: DeepSpeed's
  `_zero3_consolidated_16bit_state_dict`, which upstream calls, gathers every parameter of each module whole and drops
  the frozen ones only afterwards (still so in deepspeed 0.19.8); parameters ZeRO-3 keeps whole on every rank
  (`stage3_param_persistence_threshold`) are read as they are. No exception: the Trainer saves the adapter as with the
  flag on, and neither writes the dummy files nor DeepSpeed's full checkpoint into the `save_model` folder (as 5.x); a
  `checkpoint-N` still gets DeepSpeed's checkpoint from `_save_optimizer_and_scheduler`, for resuming;
- everywhere else (no PEFT, the flag on, ZeRO < 3, tensor parallelism) calls accelerate exactly as stock, so the
  behaviour (and the warning and full checkpoint without the flag) is stock.

The tensors are copied (`.to("cpu", copy=True)`) in the dtype they train in, as DeepSpeed's consolidation does. The
adapter saved equals the trained one exactly and loads with `PeftModel.from_pretrained`.

How: `txn.recode` rebuilds `Trainer.save_model` from the installed source with that one call replaced (line numbers
kept, no wrapper); the Trainer's other code, and anything that subclasses it, runs as before.
"""
from dspatch.spec import Patch, Signature

PEFT_AT_WORK = (r"[/\\]peft[/\\]|trainable params: [\d,]+ \|\| all params|adapter_model\.(safetensors|bin)|"
                r"adapter_config\.json|\bLora(Config|Model)\b|\blora_[AB]\b")

PID = "transformers/peft-zero3-save"
TRAINER = "transformers.trainer"

# Trainer.save_model as released (tests/test_releases.py recomputes them from every sdist); the
# DeepSpeed branch the patch edits is the same in all of them, the bands differ elsewhere in the function
FINGERPRINTS = {
    (TRAINER, "Trainer.save_model"): {"739c927f4e756a64": "4.44.0-4.52.4", "e9febda0d6908cd3": "4.53.0-4.54.0",
                                      "ec8f18c40d9ebaea": "4.54.1-4.56.2", "508e08e47123701d": "4.57.1-4.57.6"},
}


def ask_dspatch(definition):
    """Transform: inside `elif self.is_deepspeed_enabled:` of save_model, the one call
    `self.accelerator.get_state_dict(self.deepspeed)` becomes `<this module>.state_dict_for_save(self)`."""
    import ast

    from dspatch.rewrite import call_into, expression, find_one, matches

    branch = find_one(definition, lambda n: isinstance(n, ast.If) and matches(n.test, "self.is_deepspeed_enabled"),
                      "`elif self.is_deepspeed_enabled:`")
    wanted = "self.accelerator.get_state_dict(self.deepspeed)"
    parent = find_one(branch, lambda n: any(matches(v, wanted) for _, v in ast.iter_fields(n)), wanted)
    field, call = next((f, v) for f, v in ast.iter_fields(parent) if matches(v, wanted))
    setattr(parent, field, expression(f"{call_into(__name__, 'state_dict_for_save')}(self)", call))


def apply(txn):
    txn.recode(txn.target("Trainer.save_model"), ask_dspatch)


def _needs_trainable_gather(trainer):
    """A PEFT model at ZeRO-3 whose config does not let accelerate gather (the case stock saves empty)."""
    from transformers.trainer import _is_peft_model

    config = trainer.accelerator.deepspeed_config or {}
    zero = config.get("zero_optimization") or {}
    tensor_parallel = (config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0
    return (_is_peft_model(trainer.model) and zero.get("stage") == 3 and tensor_parallel <= 1
            and not trainer.deepspeed.zero_gather_16bit_weights_on_model_save())


def state_dict_for_save(trainer):
    """What the patched `Trainer.save_model` uses as the state dict of its DeepSpeed branch."""
    if _needs_trainable_gather(trainer):
        # settle ZeRO-3's gathers first: GatheredParameters gathers only what is not available, so a parameter
        # whose prefetch is still in flight would be read before it arrives (a precaution: the 2-rank flake once
        # blamed on this was deepspeed/zero3-gather-waits-all)
        trainer.deepspeed.empty_partition_cache()
        return trainable_state_dict(trainer.deepspeed.module, keep=trainer.args.should_save)
    return trainer.accelerator.get_state_dict(trainer.deepspeed)


def trainable_state_dict(model, keep):
    """The trainable parameters (and persistent buffers) of a ZeRO-3 model, keyed as in `model.state_dict()`.

    Must be called on every rank (it gathers); ranks with `keep` false get {}. Gathers only parameters with
    requires_grad, one module at a time, and only those ZeRO-3 holds partitioned; frozen ones are not touched."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    state_dict, copies = {}, {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        trainable = [(name, p) for name, p in module.named_parameters(recurse=False) if p.requires_grad]
        # parameters ZeRO-3 keeps whole on every rank (persistent ones) are read as they are
        partitioned = [p for _, p in trainable
                       if getattr(p, "ds_status", ZeroParamStatus.AVAILABLE) != ZeroParamStatus.AVAILABLE]
        with deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned)):
            if keep:
                for name, p in trainable:
                    if id(p) not in copies:  # a shared parameter: one tensor under each of its names
                        copies[id(p)] = p.detach().to("cpu", copy=True)
                    state_dict[prefix + name] = copies[id(p)]
        if keep:
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in module._non_persistent_buffers_set:
                    state_dict[prefix + name] = buf.detach().to("cpu", copy=True)
    return state_dict


PATCH = Patch(
    id=PID,
    summary=("Trainer + PEFT at ZeRO-3 without stage3_gather_16bit_weights_on_model_save saves the trained adapter, "
             "not an empty 40-byte file (save_model and checkpoints); only trainable weights are gathered"),
    cause=("At ZeRO-3 the Trainer saves the PEFT adapter from partitioned weights, which hold no data on the "
           "rank"),
    symptom="`adapter_model.safetensors` of 40 bytes, no tensors: the trained adapter silently lost",
    distribution="transformers",
    affected="<5.0.0",
    fixed_in="5.0.0",
    supported=">=4.44.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/pull/41416", "https://github.com/huggingface/trl/issues/4416",
           "https://github.com/huggingface/peft/issues/2892", "https://github.com/deepspeedai/DeepSpeed/pull/7900"),
    diffs=("transformers/0002-peft-zero3-save-4.44.0-4.57.6.patch",),
    # The bug raises nothing. What its log shows is the Trainer's warning for this fallback; the same line is
    # logged (correctly) for a model without PEFT, whose full weights are in DeepSpeed's checkpoint: with PEFT it
    # means the adapter file is empty.
    # the Trainer says this for every model at ZeRO-3 without the flag; a full model is saved right (zero_to_fp32),
    # so only a log that shows PEFT at work names this bug
    signatures=(Signature(r"stage3_gather_16bit_weights_on_model_save=false\. Saving the full checkpoint instead, "
                          r"use zero_to_fp32\.py to recover weights", context=(PEFT_AT_WORK,)),),
    note=("Trainer.save_model keeps its object and line numbers but runs code rebuilt from the installed file with "
          "its DeepSpeed state-dict call routed through dspatch (PEFT at ZeRO-3 without the gather flag: the "
          "trainable parameters gathered on every rank; otherwise accelerate, as stock)"),
)
