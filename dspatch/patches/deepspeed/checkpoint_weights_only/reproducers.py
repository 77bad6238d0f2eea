"""Reproducers: real deepspeed.initialize, save_checkpoint and load_checkpoint on the CPU, a tiny model.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import os

from dspatch.spec import BugSeen, Proof


_warm: list = []


def _engine(stage, **config):
    import torch

    from dspatch.scenario import init_deepspeed

    deepspeed = init_deepspeed()
    if not _warm:
        # deepspeed <= 0.16.x: the first engine built in a process trains slightly differently from every later
        # one (an upstream fact, seen here on CPU); build it once and never compare it
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


PROOF = Proof(
    scenarios={"resume_zero_stages": resume_zero_stages, "zero_to_fp32_module": zero_to_fp32_module,
               "universal_checkpoint": universal_checkpoint,
               "loading_stays_as_strict_as_asked": loading_stays_as_strict_as_asked},
    expected_on_stock={
      # every stage but 0 (stage 0 with fp32 torch Adam pickles nothing of DeepSpeed's), with either engine
      "resume_zero_stages": "load_checkpoint: UnpicklingError: Weights only load failed at ZeRO stage 1 (same engine), "
                            "stage 1 (fresh engine), stage 2 (same engine), stage 2 (fresh engine), stage 3 (same "
                            "engine), stage 3 (fresh engine)",
      "zero_to_fp32_module": "get_fp32_state_dict_from_zero_checkpoint: UnpicklingError: Weights only load failed",
      "universal_checkpoint": "load_checkpoint of a universal checkpoint: UnpicklingError: Weights only load failed"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    # A version of each package the patch `requires` with the bug's need, and one without (release suite).
    others_with_and_without=({"torch": "2.13.0"}, {"torch": "2.5.1"}),
    # The test proving each target necessary (in one process with other checks), in place of test_proofs.py's.
    necessity_proven_by="test_checkpoint_weights_only.py::test_patched_stock_and_each_target_left_out_in_one_process",
)
