"""Reproducers. Each scenario runs one 2-rank torchrun job of this module (`_job`), which trains tiny models
through real accelerate + DeepSpeed (CPU, gloo) and writes what it saw as JSON.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import json
import os

from dspatch.spec import BugSeen, Proof
from dspatch.patches.accelerate.deepspeed_no_sync import ASSERTION


def _launch(cases):
    """Run the cases in one 2-rank job; {case: result} from rank 0. Its ranks' tracebacks go to stderr."""
    from dspatch.scenario import launch_ranks

    results = launch_ranks(__name__, cases)[0]
    record = os.environ.get("DSPATCH_NO_SYNC_RECORD")
    if record:  # what the tests compare between runs (patched, upstream's diff, stock on a fixed release)
        previous = {}
        if os.path.exists(record):
            with open(record) as f:
                previous = json.load(f)
        with open(record, "w") as f:
            json.dump({**previous, **results}, f)
    return results


CASES = ("accumulate-2", "sync_each_batch-2", "accumulate-3", "sync_each_batch-3", "no_sync-2", "native-2",
         "accumulate-1", "sync_each_batch-1", "trainer-2")
_ran: dict = {}


def _results(cases):
    """Every case's result from one job per patch state (a job's start costs more than most cases): the
    scenarios of one verify run share it."""
    from dspatch.scenario import rank_environment

    env = rank_environment()
    key = (env.get("DSPATCH"), env.get("PYTHONPATH"))
    if key not in _ran:
        _ran.clear()
        _ran[key] = _launch(CASES)
    return {case: _ran[key][case] for case in cases}


def _bug(results, cases):
    failed = [(case, results[case]["error"]) for case in cases if "error" in results[case]]
    if failed:
        raise BugSeen("; ".join(f"{case}: {error}" for case, error in failed))


def _same(results, case, reference):
    a, b = results[case], results[reference]
    if a["losses"] != b["losses"] or a["params"] != b["params"]:
        raise BugSeen(f"{case} trained differently from {reference}: losses {a['losses']} vs {b['losses']}")


def accumulate_zero2_zero3():
    """A custom loop over `accelerator.accumulate(model)` with gradient accumulation 2 at ZeRO-2 and ZeRO-3 trains,
    and its losses and parameters are bit-identical to the same loop with `sync_each_batch=True` (accumulate then
    never enters no_sync: what upstream's fix makes no_sync be at these stages)."""
    cases = ["accumulate-2", "sync_each_batch-2", "accumulate-3", "sync_each_batch-3"]
    results = _results(cases)
    _bug(results, cases)
    _same(results, "accumulate-2", "sync_each_batch-2")
    _same(results, "accumulate-3", "sync_each_batch-3")


def no_sync_zero2_and_zero1():
    """`with accelerator.no_sync(model):` around the first micro-step of each accumulation window of DeepSpeed's
    own loop (`engine.backward` and `engine.step` every micro-step, the engine counting the window): at ZeRO-2 it
    trains bit-identically to the same loop without no_sync. At ZeRO-1 `accumulate` still enters DeepSpeed's own
    no_sync on each non-boundary micro-step, as on stock (the tests also check its numbers against stock's)."""
    cases = ["no_sync-2", "native-2", "accumulate-1", "sync_each_batch-1"]
    results = _results(cases)
    _bug(results, cases)
    _same(results, "no_sync-2", "native-2")
    entered = {case: results[case]["entered_deepspeed_no_sync"] for case in ("accumulate-1", "sync_each_batch-1")}
    if entered != {"accumulate-1": 2, "sync_each_batch-1": 0}:
        raise BugSeen(f"at ZeRO-1 accumulate did not enter DeepSpeed's no_sync on each of the 2 non-boundary "
                      f"micro-steps (and only there): {entered}")


def trainer_zero2():
    """transformers' Trainer (a tiny Llama) with gradient_accumulation_steps=2 at ZeRO-2 trains 2 optimizer steps,
    its losses finite and its weights changed (the tests compare its numbers with upstream's fix applied)."""
    cases = ["trainer-2"]
    results = _results(cases)
    _bug(results, cases)
    import math

    losses = results["trainer-2"]["losses"]
    if len(losses) != 2 or not all(math.isfinite(x) for x in losses) or not results["trainer-2"]["changed"]:
        raise BugSeen(f"trainer-2: the Trainer did not train: {results['trainer-2']}")


# ----------------------------------------------------------------------------------------------------
# The job's ranks (`python -m <this module> OUT CASE...` under torchrun).

def _setup():
    import importlib

    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    import torch

    torch.set_num_threads(1)
    # the shm op is a 90-115 s JIT build on 2 cores and only speeds up CPU collectives
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _snapshot(engine):
    """{name: values} of the optimizer's full fp32 copy of every parameter (gathered from the ranks' partitions at
    ZeRO-1/2/3): the state training goes on from."""
    import torch.distributed
    from deepspeed.utils import safe_get_full_fp32_param

    torch.distributed.barrier()
    return {n: safe_get_full_fp32_param(p).double().flatten().tolist() for n, p in engine.module.named_parameters()}


def _count_deepspeed_no_sync():
    """A counter of entries into DeepSpeedEngine.no_sync (instrumentation of the job, not of the fix)."""
    import contextlib

    from deepspeed.runtime.engine import DeepSpeedEngine

    counter = {"n": 0}
    original = DeepSpeedEngine.no_sync

    @contextlib.contextmanager
    def counting(self):
        counter["n"] += 1
        with original(self):
            yield

    return counter, original, counting


def _loop(mode, stage):
    from contextlib import nullcontext

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, GradientAccumulationPlugin
    from deepspeed.runtime.engine import DeepSpeedEngine

    from dspatch.scenario import reset_accelerate

    reset_accelerate()
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=2)
    plugin.deepspeed_config["zero_optimization"].update(stage3_param_persistence_threshold=0) if stage == 3 else None
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=2, sync_each_batch=mode == "sync_each_batch"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    engine, optimizer = accelerator.prepare(model, optimizer)
    counter, original, counting = _count_deepspeed_no_sync()
    if stage < 2:  # where DeepSpeed's no_sync works: count its entries (at ZeRO >= 2 a traceback shows upstream only)
        DeepSpeedEngine.no_sync = counting
    losses = []
    try:
        for step in range(4):  # 2 optimizer steps of 2 micro-steps; each rank its own batches
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * accelerator.process_index + step))
            if mode in ("accumulate", "sync_each_batch"):  # accelerate's loop
                with accelerator.accumulate(engine):
                    loss = engine(x).pow(2).mean()
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            else:  # DeepSpeed's own loop: the engine counts the accumulation window
                window = accelerator.no_sync(engine) if mode == "no_sync" and step % 2 == 0 else nullcontext()
                with window:
                    loss = engine(x).pow(2).mean()
                    engine.backward(loss)
                engine.step()
            losses.append(loss.item())
    finally:
        DeepSpeedEngine.no_sync = original
    return {"losses": losses, "params": _snapshot(engine), "entered_deepspeed_no_sync": counter["n"]}


def _trainer(stage):
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from dspatch.scenario import reset_accelerate, tiny_llama

    reset_accelerate()
    model = tiny_llama(max_position_embeddings=32)
    generator = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
            for ids in torch.randint(0, 64, (8, 8), generator=generator)]
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "zero_optimization": zero, "steps_per_print": 10**6}
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                 max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                                 report_to=[], deepspeed=ds, ddp_backend="gloo", use_cpu=True, seed=0,
                                 disable_tqdm=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        after = _snapshot(trainer.model_wrapped)
    changed = any(after[n] != before[n].double().flatten().tolist() for n in before)
    return {"losses": losses, "params": after, "changed": changed}


def _job(out, cases):
    import sys
    import time
    import traceback

    from dspatch.scenario import settle

    _setup()
    import accelerate  # noqa: F401  (imported before the heap is frozen)
    import transformers  # noqa: F401

    results = {}
    for case in cases:
        mode, _, stage = case.rpartition("-")
        settle()
        started = time.perf_counter()
        try:
            results[case] = _trainer(int(stage)) if mode == "trainer" else _loop(mode, int(stage))
        except AssertionError as e:
            if ASSERTION not in str(e):
                raise
            traceback.print_exc(file=sys.stderr)  # upstream's own traceback, as a user's log shows it
            results[case] = {"error": f"AssertionError: {e}"}
        if int(os.environ.get("RANK", "0")) == 0 and os.environ.get("DSPATCH_NO_SYNC_TIMES"):
            print(f"case {case}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    from dspatch.scenario import finish_rank

    finish_rank(out, results)


PROOF = Proof(
    scenarios={"accumulate_zero2_zero3": accumulate_zero2_zero3, "no_sync_zero2_and_zero1": no_sync_zero2_and_zero1,
               "trainer_zero2": trainer_zero2},
    expected_on_stock={
      "accumulate_zero2_zero3": f"accumulate-2: AssertionError: {ASSERTION} 2",
      "no_sync_zero2_and_zero1": f"no_sync-2: AssertionError: {ASSERTION} 2",
      "trainer_zero2": f"trainer-2: AssertionError: {ASSERTION} 2"},
    # The releases of accelerate that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.20.0", "1.15.0"),
    # A version of each package the patch `requires` with the bug's need, and one without (release suite).
    others_with_and_without=({"deepspeed": "0.16.9"}, {"deepspeed": "0.15.4"}),
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1], sys.argv[2:])
