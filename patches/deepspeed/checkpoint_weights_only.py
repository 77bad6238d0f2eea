"""DeepSpeed <= 0.15.4 on torch >= 2.6 cannot load its own checkpoints: its loaders pass `weights_only=False`.

torch 2.6 changed `torch.load`'s default to `weights_only=True`, which refuses any pickled object that is not a
tensor or a plain container. DeepSpeed's checkpoints hold its own objects (the ZeRO optimizer's `LossScaler`
and `ZeroStageEnum`, whatever the user passed as `client_state`), so on deepspeed <= 0.15.4 with torch >= 2.6
`engine.load_checkpoint` fails with `UnpicklingError: Weights only load failed` at ZeRO stages 1-3 (and at
stage 0 too once the checkpoint holds such an object). Upstream PR 6751 (0.16.0) passes `weights_only=False` in
every `torch.load` of DeepSpeed's own files.

The patch does the same, in the loaders a training job or a user's code reaches in every release it gates
(0.14.1-0.15.4, one released source each):
- `TorchCheckpointEngine.load`: every file `engine.load_checkpoint` reads (model and ZeRO optimizer states,
  a universal checkpoint's model states);
- `ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir`: a universal checkpoint's `optimizer_state.pt`
  (`"checkpoint": {"load_universal": true}`, ZeRO-1/2 and bf16);
- `deepspeed.utils.zero_to_fp32.parse_model_states` / `parse_optim_states`: `zero_to_fp32` used as a module
  (`get_fp32_state_dict_from_zero_checkpoint`, `load_state_dict_from_zero_checkpoint`).

How: each target is rebuilt from the installed source (`txn.recode`) with one change: its `torch.load(...)`
call gets the keyword `weights_only=False`, as in upstream's diff. Nothing else changes: `torch.load` itself
keeps torch's default for every other caller (the user's own code included), a call that already names
`weights_only` (or passes `**kwargs`) is left as it is, and `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1` still wins
(torch applies it over an explicit `weights_only=False`), so a user who asked for weights-only loading
everywhere still gets it.

Not covered, and why: `zero_to_fp32.py` as copied into each checkpoint folder and `ds_to_universal` run as
scripts (`__main__`, out of reach of an import hook; run them with `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`, or
apply the upstream diff to the installed deepspeed, whose zero_to_fp32.py save_checkpoint then copies);
ZeRO-3 universal loading (`DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state*`, 0.15.0-0.15.4 only: a
target must exist in every release the patch gates, and no stack here runs 0.15.x); the Nebula engine (needs
Azure's torch_nebula); the inference loaders' own torch.load calls, which read model weight files (plain
state dicts) for inference, not DeepSpeed's training state (a DeepSpeed checkpoint given to the inference
engine goes through TorchCheckpointEngine.load). Files written by ds_to_universal per parameter (`fp32.pt`, `exp_avg.pt`, ...) hold only tensors and
plain values and load with weights_only=True, so `universal_checkpoint.load_hp_checkpoint_state` needs no fix.
"""
import os

from dspatch.spec import BugSeen, Patch, Target

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


def _loads(definition):
    import ast

    return [node for node in ast.walk(definition) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"]


def weights_only_false(definition):
    """Transform: `torch.load(...)` -> `torch.load(..., weights_only=False)` for each such call in the
    definition that does not name `weights_only` itself (nor pass `**kwargs`, which may)."""
    import ast

    from dspatch.rewrite import RewriteError

    sites = _loads(definition)
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


# ----------------------------------------------------------------------------------------------------
# Reproducers: real deepspeed.initialize, save_checkpoint and load_checkpoint on the CPU, a tiny model.

_warm = []


def _engine(stage, **config):
    import torch

    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    if not _warm:
        # deepspeed <= 0.16.x: the first engine built in a process trains slightly differently from every later
        # one (UPSTREAM.md section 6); build it once and never compare it
        _warm.append(True)
        _engine(stage, **config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    full = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, **config}
    engine, *_ = deepspeed.initialize(model=model, config=full, model_parameters=model.parameters())
    return engine


def _train(engine, first, last):
    """Losses of steps first..last-1; each step's batch depends on its number only, so a resumed run sees
    the batches the uninterrupted one saw."""
    import torch

    losses = []
    for step in range(first, last):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1000 + step))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _refused(error):
    """Whether `error` is torch's weights-only refusal (the bug), and not anything else."""
    import pickle

    return isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error)


def _tmpdir():
    import tempfile

    return tempfile.mkdtemp(prefix="dspatch-ckpt-")


def resume_zero_stages():
    """At ZeRO stages 0-3: train 2 steps, save, train 2 more (the uninterrupted run); load the checkpoint into
    the same engine and into a fresh one, and each repeats steps 3-4 with bit-identical losses."""
    import shutil

    failed, differ = [], []
    for stage in range(4):
        folder = _tmpdir()
        try:
            engine = _engine(stage)
            _train(engine, 0, 2)
            engine.save_checkpoint(folder)
            uninterrupted = _train(engine, 2, 4)
            runs = {}
            for name, resumed in (("same engine", engine), ("fresh engine", None)):
                resumed = resumed or _engine(stage)
                try:
                    path, _ = resumed.load_checkpoint(folder)
                except Exception as e:
                    if not _refused(e):
                        raise
                    failed.append(f"stage {stage} ({name})")
                    continue
                if path is None:
                    raise RuntimeError(f"stage {stage}: load_checkpoint found no checkpoint in {folder}")
                runs[name] = _train(resumed, 2, 4)
            differ += [f"stage {stage} ({name}): {losses} vs {uninterrupted}" for name, losses in runs.items()
                       if losses != uninterrupted]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if failed:
        raise BugSeen(f"load_checkpoint: UnpicklingError: Weights only load failed at ZeRO {', '.join(failed)}")
    if differ:
        raise BugSeen(f"resumed losses differ from the uninterrupted run: {'; '.join(differ)}")


def zero_to_fp32_module():
    """`get_fp32_state_dict_from_zero_checkpoint` (zero_to_fp32 as a module) of ZeRO-2 and ZeRO-3 checkpoints
    whose client_state holds an argparse.Namespace (as Megatron-DeepSpeed saves its `args`) gives the
    engine's fp32 weights exactly."""
    import argparse
    import shutil

    import torch

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    failed = []
    for stage in (2, 3):
        folder = _tmpdir()
        try:
            engine = _engine(stage)
            _train(engine, 0, 2)
            engine.save_checkpoint(folder, client_state={"args": argparse.Namespace(lr=1e-2, seed=0)})
            try:
                consolidated = get_fp32_state_dict_from_zero_checkpoint(folder)
            except Exception as e:
                if not _refused(e):
                    raise
                failed.append(f"ZeRO-{stage}")
                continue
            import deepspeed

            params = dict(engine.module.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
                wrong = [n for n, p in params.items() if not torch.equal(consolidated[n].float(), p.detach().float())]
            if wrong or set(consolidated) != set(params):
                raise BugSeen(f"ZeRO-{stage}: zero_to_fp32 gave other weights than the engine's: {wrong}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if failed:
        raise BugSeen(f"get_fp32_state_dict_from_zero_checkpoint: UnpicklingError: Weights only load failed "
                      f"({', '.join(failed)})")


def universal_checkpoint():
    """A ZeRO-1 checkpoint converted by ds_to_universal (run as the script it is, with the documented
    workaround TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1) loads into a fresh engine with "load_universal", and the
    resumed steps give bit-identical losses to the uninterrupted run."""
    import shutil
    import subprocess
    import sys

    folder, universal = _tmpdir(), _tmpdir()
    try:
        engine = _engine(1)
        _train(engine, 0, 2)
        engine.save_checkpoint(folder, tag="step2", client_state={"universal_checkpoint_info": {}})
        uninterrupted = _train(engine, 2, 4)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSPATCH")}
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        os.path.join(folder, "step2"), "--output_folder", os.path.join(universal, "step2"),
                        "--num_extract_workers", "1", "--num_merge_workers", "1"],
                       env=env, check=True, capture_output=True, text=True)
        with open(os.path.join(universal, "latest_universal"), "w") as f:
            f.write("step2")
        resumed = _engine(1, checkpoint={"load_universal": True})
        try:
            resumed.load_checkpoint(universal)
        except Exception as e:
            if not _refused(e):
                raise
            raise BugSeen("load_checkpoint of a universal checkpoint: UnpicklingError: Weights only load failed") from e
        losses = _train(resumed, 2, 4)
        if losses != uninterrupted:
            raise BugSeen(f"losses after loading the universal checkpoint {losses} differ from {uninterrupted}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(universal, ignore_errors=True)


def loading_stays_as_strict_as_asked():
    """Only DeepSpeed's own loads change: the user's `torch.load` of the same file keeps torch's default
    (weights-only, refused), and with TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 even DeepSpeed's loads stay refused."""
    import glob
    import shutil

    import torch

    folder = _tmpdir()
    forced = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    try:
        engine = _engine(2)
        _train(engine, 0, 1)
        engine.save_checkpoint(folder, tag="t")
        optim_states = glob.glob(os.path.join(folder, "t", "*optim_states.pt"))[0]
        try:
            torch.load(optim_states)
            raise BugSeen("torch.load's own default changed: a DeepSpeed optimizer file loaded without weights_only")
        except Exception as e:
            if not _refused(e):
                raise
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
        try:
            engine.load_checkpoint(folder, tag="t")
            raise BugSeen("load_checkpoint ignored TORCH_FORCE_WEIGHTS_ONLY_LOAD=1")
        except Exception as e:
            if not _refused(e):
                raise
    finally:
        if forced is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = forced
        shutil.rmtree(folder, ignore_errors=True)


PATCH = Patch(
    id="deepspeed/checkpoint-weights-only",
    summary=("DeepSpeed cannot load its own checkpoints on torch >= 2.6 (weights_only default); its loaders "
             "pass weights_only=False as upstream does since 0.16.0"),
    distribution="deepspeed",
    affected="<=0.15.4",
    fixed_in="0.16.0",
    requires={"torch": ">=2.6"},
    targets=[Target(module, qualname, prints) for (module, qualname), prints in FINGERPRINTS.items()],
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/6751",),
    # 0.14.0 loads universal checkpoints through other functions and does not import with torch 2.13; older
    # releases cannot use the CPU accelerator: the patch is written and run for 0.14.1-0.15.4
    supported=">=0.14.1",
    diffs={">=0.14.1,<=0.15.4": "deepspeed/0002-checkpoint-weights-only-0.14.1-0.15.4.patch"},
    scenarios={"resume_zero_stages": resume_zero_stages, "zero_to_fp32_module": zero_to_fp32_module,
               "universal_checkpoint": universal_checkpoint,
               "loading_stays_as_strict_as_asked": loading_stays_as_strict_as_asked},
    expected_on_stock={
        "resume_zero_stages": "load_checkpoint: UnpicklingError: Weights only load failed at ZeRO stage 1",
        "zero_to_fp32_module": "get_fp32_state_dict_from_zero_checkpoint: UnpicklingError: Weights only load failed",
        "universal_checkpoint": "load_checkpoint of a universal checkpoint: UnpicklingError: Weights only load failed"},
    # torch's refusal, raised from one of deepspeed's loaders
    signatures=((r"File \".*deepspeed[/\\].*\.py\", line \d+", r"UnpicklingError: Weights only load failed"),),
    note=("the four loaders keep their objects, names and line numbers but run code rebuilt from the installed "
          "file with `weights_only=False` added to its torch.load call; only load checkpoints you trust "
          "(a pickle can run code), as with upstream >= 0.16.0"),
)
