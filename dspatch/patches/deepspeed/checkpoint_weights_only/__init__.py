"""DeepSpeed <= 0.15.4 on torch >= 2.6 cannot load its own checkpoints: its loaders pass `weights_only=False`.

torch 2.6 changed `torch.load`'s default to `weights_only=True`, which refuses any pickled object that is not a tensor
or a plain container, and deepspeed <= 0.15.4 never says otherwise. DeepSpeed's checkpoints hold its own objects (the
ZeRO optimizer's `LossScaler` and `ZeroStageEnum`, whatever the user passed as `client_state`), so with torch >= 2.6
`engine.load_checkpoint` fails with `UnpicklingError: Weights only load failed` at ZeRO stages 1-3 (and at stage 0 too
once `client_state` holds such an object), and so do loading a universal checkpoint (`"checkpoint": {"load_universal":
true}`) and `zero_to_fp32` used as a module (`get_fp32_state_dict_from_zero_checkpoint`). Upstream PR 6751 (0.16.0)
passes `weights_only=False` in every `torch.load` of DeepSpeed's own files. With torch < 2.6 the verdict is **not
affected**.

The patch does the same, in the loaders a training job or a user's code reaches in every release it gates
(0.14.1-0.15.4, one released source each):
- `TorchCheckpointEngine.load`: every file `engine.load_checkpoint` reads (model and ZeRO optimizer states, a universal
  checkpoint's model states);
- `ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir`: a universal checkpoint's `optimizer_state.pt` (ZeRO-1/2
  and bf16);
- `deepspeed.utils.zero_to_fp32.parse_model_states` / `parse_optim_states`: `zero_to_fp32` used as a module
  (`get_fp32_state_dict_from_zero_checkpoint`, `load_state_dict_from_zero_checkpoint`).

How: each target is rebuilt from the installed source (`txn.recode`) with one change: its `torch.load(...)` call gets
the keyword `weights_only=False`, as in upstream's diff. Nothing else changes: `torch.load` itself keeps torch's default
for every other caller (the user's own code included), a call that already names `weights_only` (or passes `**kwargs`)
is left as it is, and `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1` still wins (torch applies it over an explicit
`weights_only=False`), so a user who asked for weights-only loading everywhere still gets it. `weights_only=False`
unpickles arbitrary objects, and a malicious pickle can run code: load only checkpoints you trust, exactly as with
upstream >= 0.16.0.

Not covered, and why:
- `zero_to_fp32.py` as copied into each checkpoint folder by `save_checkpoint`, and `ds_to_universal`: they run as
  scripts (`__main__`), out of reach of an import hook. Run them as `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 python
  zero_to_fp32.py ...`, or apply `upstream_prs/deepspeed/0002-*.patch` to the installed deepspeed, after which newly
  saved checkpoints carry a fixed script.
- ZeRO-3 universal checkpoint loading (`DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state*`, 0.15.0-0.15.4 only): a
  target must exist in every release the patch gates, and no stack here runs 0.15.x.
- the Nebula engine (needs Azure's torch_nebula);
- the inference loaders' own `torch.load` calls, which read model weight files (plain state dicts) for inference, not
  DeepSpeed's training state (a DeepSpeed checkpoint given to the inference engine goes through
  `TorchCheckpointEngine.load`).

Files written by `ds_to_universal` per parameter (`fp32.pt`, `exp_avg.pt`, ...) hold only tensors and plain values and
load with `weights_only=True`, so `universal_checkpoint.load_hp_checkpoint_state` needs no fix. 0.14.0 (which cannot
import with torch 2.13 and loads universal checkpoints through other functions) is "unsupported".
"""

from dspatch.spec import Patch, Signature

CKPT_ENGINE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine"
BASE_OPTIMIZER = "deepspeed.runtime.base_optimizer"
ZERO_TO_FP32 = "deepspeed.utils.zero_to_fp32"

# The released source of every target in the releases the patch is written for (tests/test_gating_checkpoint_
# weights_only.py recomputes them from every sdist). 0.14.0 has neither base_optimizer.py nor this universal
# loader (ZeRO-1/2 and bf16 each had their own); 0.16.0 (PR 6751) passes weights_only=False in all of them.
FINGERPRINTS = {
    (CKPT_ENGINE, "TorchCheckpointEngine.load"): {"ad3fc14f7f79a6ee": "0.14.0-0.15.4"},
    (BASE_OPTIMIZER, "ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir"): {"85a572ff5a558f22": "0.14.1-0.15.4"},
    (ZERO_TO_FP32, "parse_model_states"): {"a29043a7ba475768": "0.14.0-0.15.4"},
    (ZERO_TO_FP32, "parse_optim_states"): {"870025f05add212e": "0.14.0-0.15.4"},
}


def weights_only_false(definition):
    """Transform: `torch.load(...)` -> `torch.load(..., weights_only=False)` for each such call in the
    definition that does not name `weights_only` itself (nor pass `**kwargs`, which may)."""
    import ast

    from dspatch.rewrite import RewriteError, find_all

    sites = find_all(definition, "torch.load(...)")
    if not sites:
        raise RewriteError(f"{definition.name}: no `torch.load(...)` call to pass weights_only=False to")
    for call in sites:
        if any(k.arg in ("weights_only", None) for k in call.keywords):
            continue  # the caller's own choice stands
        value = ast.copy_location(ast.Constant(False), call)  # tracebacks point at upstream's line
        call.keywords.append(ast.copy_location(ast.keyword(arg="weights_only", value=value), call))


def apply(txn):
    # Upstream's own function objects get code rebuilt from the installed source with that one keyword added:
    # no wrapper, nothing global (torch.load and its default are untouched), no cost per call.
    for target in txn.patch.targets:
        txn.recode(target, weights_only_false)


PATCH = Patch(
    id="deepspeed/checkpoint-weights-only",
    summary=("DeepSpeed cannot load its own checkpoints on torch >= 2.6 (weights_only default); its loaders "
             "pass weights_only=False as upstream does since 0.16.0"),
    cause="torch >= 2.6 loads weights-only by default, and DeepSpeed's checkpoint loaders hold more than weights",
    symptom="`UnpicklingError: Weights only load failed` in `engine.load_checkpoint` (torch >= 2.6)",
    distribution="deepspeed",
    affected="<=0.15.4",
    fixed_in="0.16.0",
    requires={"torch": ">=2.6"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/6751",),
    # 0.14.0 loads universal checkpoints through other functions and does not import with torch 2.13; older
    # releases cannot use the CPU accelerator: the patch is written and run for 0.14.1-0.15.4
    supported=">=0.14.1",
    diffs=("deepspeed/0002-checkpoint-weights-only-0.14.1-0.15.4.patch",),
    # DeepSpeed's own load: a deepspeed frame or a deepspeed global refused (torch.load elsewhere is not this bug)
    # a DeepSpeed global in the refusal says a DeepSpeed checkpoint was loaded, not by whom: every loader of one with
    # weights_only on torch >= 2.6 writes it (newer DeepSpeed engines, a user's torch.load); a frame of the four
    # affected loaders decides
    signatures=(Signature(r"Weights only load failed", error="UnpicklingError",
                          needs=(r"[/\\]deepspeed[/\\].*\.py|GLOBAL deepspeed\.|deepspeed\.runtime\.",),
                          hints=(r"torch_checkpoint_engine\.py|base_optimizer\.py|zero_to_fp32\.py|\b(parse_model_states"
                                 r"|parse_optim_states|load_hp_checkpoint_state_from_checkpoint_dir)\b",),
                          tell="a frame of DeepSpeed's torch_checkpoint_engine.py, base_optimizer.py or zero_to_fp32.py "
                               "is in the traceback",
                          also="another loader of a DeepSpeed checkpoint with weights_only on torch >= 2.6 (DeepSpeed's "
                               "newer checkpoint engines, a user's or a framework's own torch.load) writes the same "
                               "lines"),),
    note=("the four loaders keep their objects, names and line numbers but run code rebuilt from the installed "
          "file with `weights_only=False` added to its torch.load call; only load checkpoints you trust "
          "(a pickle can run code), as with upstream >= 0.16.0"),
)
