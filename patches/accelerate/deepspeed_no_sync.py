"""Gradient accumulation under ZeRO-2/3 no longer dies on DeepSpeed's `no_sync` (accelerate < 1.9, deepspeed >= 0.16).

deepspeed 0.16.0 added `DeepSpeedEngine.no_sync()`, a context manager that skips the gradient all-reduce of the
backward passes inside it, and asserts that the engine does not partition gradients:
`AssertionError: no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage 2` (or 3).
accelerate's `Accelerator.no_sync(model)` enters `model.no_sync()` whenever the job is distributed and the model
has one, and `Accelerator.accumulate(model)` enters `Accelerator.no_sync` on every micro-step that is not an
accumulation boundary. So with deepspeed >= 0.16 and accelerate <= 1.8.1, every multi-process job with gradient
accumulation at ZeRO-2 or ZeRO-3 fails on its first micro-step, in custom loops (`accelerator.accumulate`,
`accelerator.no_sync`) and in the Trainer (transformers 4.46.2-4.47.0 call `accelerator.no_sync` directly on the
micro-steps of an accumulation window; earlier releases go through `accumulate`). Upstream: deepspeedai/DeepSpeed
issue 6793, huggingface/transformers issue 34984 and PR 35157 (4.47.1: the Trainer stops calling no_sync under
DeepSpeed), huggingface/accelerate issue 3481 and PR 3656 (1.9.0: `Accelerator.no_sync` enters the model's
`no_sync` under DeepSpeed only below ZeRO stage 2).

What the fix does, as accelerate 1.9.0 does: under DeepSpeed at ZeRO stage >= 2 (the stage of accelerate's active
DeepSpeed plugin), `Accelerator.no_sync` is a no-op; DeepSpeed itself knows the accumulation boundary (accelerate
puts its `gradient_accumulation_steps` in the DeepSpeed config) and reduces the partitioned gradients of every
micro-step as it must. ZeRO-0/1 and every other distributed type keep calling the model's `no_sync`, as before.

How: `Accelerator.no_sync` is rebuilt from the installed source (`txn.recode`) with its one statement
`context = getattr(model, "no_sync", context)` put under `if not <this module>.partitions_gradients(self):`.
No wrapper; the function object, its `@contextmanager` decorator, name and line numbers stay accelerate's.

Transformers: no patch of its own. The Trainer of 4.46.2-4.47.0 reaches DeepSpeed's no_sync only through
`Accelerator.no_sync`, which this patch fixes; with accelerate >= 1.9.0 upstream's own fix covers it. (transformers
4.47.1 skips no_sync under DeepSpeed at every stage; at ZeRO-0/1 DeepSpeed communicates only at the boundary
anyway, so keeping its no_sync there changes no number.)

The gate combines two packages: accelerate 0.26.0-1.8.1 (one released source of `Accelerator.no_sync`) *and*
deepspeed >= 0.16.0 (`requires`); with an older deepspeed `model.no_sync` does not exist (the engine forwards the
name to the model, which has none) and the verdict is "not affected", naming the deepspeed seen.

The reproducers need two processes (accelerate uses the model's no_sync only when the job is distributed): one
`torchrun --nproc_per_node 2` job of `python -m <this module>` runs every case, its ranks carrying the patch state
of the process that runs the scenarios (see `_worker_env`). "Trains correctly" is checked against references,
bit for bit (losses and the optimizer's full fp32 parameters after 2 optimizer steps of 2 micro-steps, each rank
its own batches):
- in the same job: `accumulate` at ZeRO-2/3 against the same loop with `sync_each_batch=True`, which never enters
  no_sync (what upstream's fix makes no_sync be there); `accelerator.no_sync` around DeepSpeed's own loop at
  ZeRO-2 against that loop without it;
- in the tests: every case (the Trainer's included) against the same job with upstream's fix (the diff in
  upstream_prs/, accelerate 1.9.0's change) applied to a copy of the installed accelerate, no monkeypatch; the cases
  that hit no bug (ZeRO-1, the references) against stock; and on accelerate 1.10.1 (fixed upstream) the same job
  runs stock and passes the same checks. (Checked once by hand across stacks: every custom-loop case of accelerate
  1.8.1 + deepspeed 0.16.9 patched equals accelerate 1.10.1 + deepspeed 0.16.3 stock, bit for bit; the Trainer's
  numbers differ there, transformers 4.46.3 against 4.57.6.)
Seen on the way, left alone (upstream's behaviour, fixed releases included): at ZeRO-1, `accumulate` entering
DeepSpeed's no_sync trains differently from the same loop with `sync_each_batch=True` (third loss 0.0681 against
0.0615 in this job; DeepSpeed documents that its no_sync disables its tracking of accumulation steps).
"""
import json
import os

from dspatch.spec import BugSeen, Patch, Target

ACCELERATOR = "accelerate.accelerator"
NO_SYNC = "Accelerator.no_sync"

# The released source of the target (tests/test_gating_deepspeed_no_sync.py recomputes it from every sdist):
# unchanged from 0.20.0 to 1.8.1; 1.9.0 is upstream's fix.
FINGERPRINTS = {(ACCELERATOR, NO_SYNC): {"3c6094b633f6a292": "0.20.0-1.8.1"}}

ASSERTION = "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage"


def partitions_gradients(accelerator):
    """Whether `accelerator` drives DeepSpeed at ZeRO stage >= 2, whose engine partitions gradients and cannot
    skip their reduction (its no_sync asserts)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return False
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage >= 2


def _guard_model_no_sync(definition):
    """Transform: `context = getattr(model, "no_sync", ...)` -> the same under
    `if not partitions_gradients(self):`."""
    import ast

    from dspatch.rewrite import RewriteError

    sites = []
    for parent in ast.walk(definition):
        for field in ("body", "orelse"):
            block = getattr(parent, field, None)
            if not isinstance(block, list):
                continue
            for index, node in enumerate(block):
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                        and isinstance(node.value.func, ast.Name) and node.value.func.id == "getattr"
                        and len(node.value.args) >= 2 and isinstance(node.value.args[1], ast.Constant)
                        and node.value.args[1].value == "no_sync"):
                    sites.append((block, index, node))
    if len(sites) != 1:
        raise RewriteError(f"{definition.name}: expected one `getattr(model, \"no_sync\", ...)`, found {len(sites)}")
    block, index, node = sites[0]
    guard = ast.parse(f"if not __import__({__name__!r}).{__name__.partition('.')[2]}.partitions_gradients(self):"
                      f"\n    pass").body[0]
    for sub in ast.walk(guard):  # tracebacks point at upstream's line
        if "lineno" in sub._attributes:
            ast.copy_location(sub, node)
    guard.body = [node]
    block[index] = guard


def apply(txn):
    txn.recode(txn.patch.targets[0], _guard_model_no_sync)


# ----------------------------------------------------------------------------------------------------
# Reproducers. Each scenario runs one 2-rank torchrun job of this module (`_job`), which trains tiny models
# through real accelerate + DeepSpeed (CPU, gloo) and writes what it saw as JSON.

def _fix_in_force():
    """Whether the `Accelerator.no_sync` this process runs carries the fix (patched here, or upstream's)."""
    import inspect

    from accelerate.accelerator import Accelerator

    code = inspect.unwrap(Accelerator.no_sync).__code__
    return __name__ in code.co_consts


def _worker_env():
    """The environment of the job's ranks: this one, with DSPATCH naming exactly the patches in force in this
    process (applied from the environment or by dspatch.apply(), less any target left out), so that the ranks
    run what this process would run. A copy of upstream on PYTHONPATH travels as it is."""
    from dspatch import _runtime

    ids = [pid for pid in _runtime.applied_ids() if pid != PATCH.id]
    if _fix_in_force():
        ids.append(PATCH.id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPATCH")}
    env.update(DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if ids:
        env["DSPATCH"] = ",".join(ids)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)  # this process's own rendezvous (init_deepspeed) is not the job's
    return env


def _launch(cases):
    """Run the cases in one 2-rank job; {case: result} from rank 0. Its ranks' tracebacks go to stderr."""
    import subprocess
    import sys
    import tempfile

    from dspatch.scenario import _free_port

    with tempfile.TemporaryDirectory(prefix="dspatch-no-sync-") as tmp:
        out = os.path.join(tmp, "result.json")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", _free_port(), "-m", __name__, out, *cases],
                              env=_worker_env(), capture_output=True, text=True, timeout=600, cwd=tmp)
        # what the ranks printed (upstream's tracebacks of the bug among it), as a user's job log shows it
        sys.stderr.write(proc.stderr[-20000:])
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"the 2-rank job exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}")
        with open(out) as f:
            results = json.load(f)
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
_ran = {}


def _results(cases):
    """Every case's result from one job per patch state (a job's start costs more than most cases): the
    scenarios of one verify run share it."""
    env = _worker_env()
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


def _freeze_heap():
    """ZeRO-3's set-up calls gc.collect() a dozen times (see_memory_usage), 0.7 s each over the heap that torch,
    deepspeed and transformers leave: what exists before a case is moved out of the collector's sight."""
    import gc

    gc.collect()
    gc.freeze()


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


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

    _reset()
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
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    _reset()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
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

    _setup()
    import accelerate  # noqa: F401  (imported before the heap is frozen)
    import transformers  # noqa: F401

    results = {}
    for case in cases:
        mode, _, stage = case.rpartition("-")
        _freeze_heap()
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
    import torch.distributed

    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort a normal interpreter exit ("terminate called without an active exception")


PATCH = Patch(
    id="accelerate/deepspeed-no-sync",
    summary=("Gradient accumulation at ZeRO-2/3 (accelerate's accumulate/no_sync, the Trainer) no longer fails on "
             "deepspeed >= 0.16's no_sync assertion"),
    distribution="accelerate",
    affected="<1.9.0",
    fixed_in="1.9.0",
    requires={"deepspeed": ">=0.16.0"},
    targets=[Target(module, qualname, prints) for (module, qualname), prints in FINGERPRINTS.items()],
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6793",
           "https://github.com/huggingface/accelerate/issues/3481",
           "https://github.com/huggingface/accelerate/pull/3656",
           "https://github.com/huggingface/transformers/issues/34984",
           "https://github.com/huggingface/transformers/pull/35157"),
    # transformers 4.46 (the Trainer's direct no_sync call) needs accelerate >= 0.26.0; the release tests cover
    # 0.26.0-1.8.1, all one source of Accelerator.no_sync
    supported=">=0.26.0",
    diffs={">=0.26.0,<=1.8.1": "accelerate/0002-deepspeed-no-sync-0.26.0-1.8.1.patch"},
    scenarios={"accumulate_zero2_zero3": accumulate_zero2_zero3, "no_sync_zero2_and_zero1": no_sync_zero2_and_zero1,
               "trainer_zero2": trainer_zero2},
    expected_on_stock={
        "accumulate_zero2_zero3": f"accumulate-2: AssertionError: {ASSERTION} 2",
        "no_sync_zero2_and_zero1": f"no_sync-2: AssertionError: {ASSERTION} 2",
        "trainer_zero2": f"trainer-2: AssertionError: {ASSERTION} 2"},
    signatures=(r"AssertionError: no_sync context manager is incompatible with gradient partitioning logic of "
                r"ZeRO stage",),
    note=("Accelerator.no_sync keeps its object, name and line numbers but runs code rebuilt from the installed "
          "file: under DeepSpeed at ZeRO stage >= 2 it no longer enters the engine's no_sync (as accelerate >= 1.9.0)"),
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1], sys.argv[2:])
