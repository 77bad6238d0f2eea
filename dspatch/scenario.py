"""Helpers for reproducers: run real DeepSpeed in this process, on the CPU unless told otherwise.

The recipe: DS_ACCELERATOR=cpu, the gloo backend, LOCAL_SIZE set (older ZeRO-3
calls numactl without it), single-process rendezvous variables, and no JIT build of the shm comm op.
Variables already set (by torchrun, or a GPU user running --verify) are kept.
"""
import atexit
import contextlib
import importlib
import os
import socket
import sys


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def init_deepspeed():
    """Import deepspeed with distributed initialised; returns the deepspeed module."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = _free_port()
    import deepspeed
    import torch.distributed

    if not torch.distributed.is_initialized():
        atexit.register(leave_distributed)
        if os.environ["DS_ACCELERATOR"] == "cpu":
            # the shm op is a 90-115 s JIT build on 2 cores and only speeds up CPU collectives
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo" if os.environ["DS_ACCELERATOR"] == "cpu" else None)
    return deepspeed


def on_accelerator(tensor):
    """`tensor` where DeepSpeed trains: the tensor itself on the CPU recipe (so CI's numbers are untouched), its copy
    on the GPU where the reproducers run with DS_ACCELERATOR=cuda. Inputs are built on the CPU from seeded CPU
    generators either way, so both see the same data."""
    if os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        return tensor
    from deepspeed.accelerator import get_accelerator

    return tensor.to(get_accelerator().current_device_name())


def leave_distributed():
    """Destroy the default process group, if any, before the interpreter exits: left to interpreter teardown,
    gloo's threads can abort the process ("terminate called without an active exception", exit -6) after all
    its work is done, as seen under load."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1 and torch.distributed.get_backend() == "gloo":
                # leave together: a rank that destroys its group while another still talks to it can take gloo
                # down; bounded, so that a rank that died only delays the others
                import datetime

                torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=120))
            torch.distributed.destroy_process_group()
    except Exception:  # leaving must not turn a finished run into a failure
        pass


def zero3_config(**zero):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 64, **zero},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    return config


@contextlib.contextmanager
def loads_past_weights_only_bug(unless_applied="deepspeed/checkpoint-weights-only"):
    """For reproducers that load checkpoints: deepspeed <= 0.15.4 (and old transformers' rng-state load) cannot
    torch.load their own checkpoints on torch >= 2.6 (another bug, dspatch's deepspeed/checkpoint-weights-only).
    Unless `unless_applied` is applied in this process, the loads inside use torch's own escape hatch
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (no effect where the caller passes weights_only itself), so that a
    reproducer shows its own bug and nothing else on every release."""
    if unless_applied and applied(unless_applied):
        yield
        return
    before = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = before


def reset_accelerate():
    """Forget accelerate's process-wide state (its singletons outlive an Accelerator), so that the next
    Accelerator or Trainer of this process is configured from scratch, as in a fresh job."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # TrainingArguments(deepspeed=...) announces DeepSpeed to accelerate through the environment, which outlives it:
    # a later Trainer without DeepSpeed would be given one
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)


def applied(pid):
    """Whether dspatch applied patch `pid` in this process (from DSPATCH at start-up or dspatch.apply())."""
    from dspatch import _runtime

    return pid in _runtime.applied_ids()


_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def settle():
    """Collect the garbage there is, then freeze what is left (the imported stack, mostly) out of the collector's
    reach: ZeRO-3's set-up calls gc.collect() a dozen times per engine (see_memory_usage, forced), and each full
    collection walks every object of torch, transformers and deepspeed (0.46 s on 2 cores: two thirds of a Trainer
    scenario's time). Called between scenarios, or in a rank before its work: the objects made afterwards are
    collected as usual."""
    import gc

    gc.collect()
    gc.freeze()


def rank_environment():
    """The environment of a job this process launches: its own, with DSPATCH naming exactly the patches in force
    here (a proof that leaves one target out leaves the whole patch out of the ranks) and those selected that wait
    for a module this process did not import, and without this process's own rendezvous. A copy of upstream on
    PYTHONPATH travels as it is."""
    from dspatch import _runtime

    # in force here, or selected and waiting for an import this process never made
    ids = [pid for pid in _runtime.applied_ids() if _runtime.in_force(pid)] + list(_runtime.state.pending)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPATCH") and k not in _RENDEZVOUS}
    env.update(DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if ids:
        env["DSPATCH"] = ",".join(ids)
    return env


def launch_ranks(module, args=(), nproc=2, timeout=600):
    """Run `python -m <module> <folder> <args...>` as an `nproc`-rank job (gloo on the CPU), with
    rank_environment(); each rank writes its result with finish_rank. Returns the ranks' results in rank order.
    What the ranks print to stderr (upstream's tracebacks among it) is forwarded to this process's stderr, as a
    job's log shows it.

    The ranks are forked from this process where that starts them as torchrun would (see _fork_refused): a rank's
    interpreter start and imports are most of a small job's time (2 x 8-10 s on 2 cores, against 1-3 s of work).
    Otherwise, or with DSPATCH_RANKS=torchrun, they are torchrun's fresh interpreters."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dspatch-ranks-") as folder:
        refused = _fork_refused()
        how = f"torchrun ({refused})" if refused else "forked ranks"
        code, stdout, stderr = (_torchrun if refused else _forked)(module, folder, args, nproc, timeout)
        sys.stderr.write(stderr[-20000:])
        paths = [os.path.join(folder, f"rank{rank}.json") for rank in range(nproc)]
        if code != 0 or not all(os.path.exists(p) for p in paths):
            raise RuntimeError(f"the {nproc}-rank job of {module} ({how}) exited {code}:\n{stdout[-3000:]}\n"
                               f"{stderr[-6000:]}")
        results = []
        for path in paths:
            with open(path) as f:
                results.append(json.load(f))
        return results


def _rendezvous(rank, nproc, port):
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def _torchrun(module, folder, args, nproc, timeout):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_addr", "127.0.0.1", "--master_port", _free_port(), "-m", module, folder,
                           *args], env=rank_environment(), capture_output=True, text=True, timeout=timeout,
                          cwd=folder)
    return proc.returncode, proc.stdout, proc.stderr


def _fork_refused():
    """Why this process cannot fork the ranks of a job as torchrun would start them, or None. A forked rank is
    this process, imports and patches included, so it must hold nothing a fresh rank would not: no process group,
    no accelerate state, no thread but the main one in Python. (Native threads: OpenBLAS re-creates its pool after a
    fork, and a rank runs torch on one thread, as OMP_NUM_THREADS=1 gives torchrun's ranks, so torch's OpenMP pool
    is never used there.) Patches whose targets a proof leaves out are reverted in the rank, which then runs without
    the whole patch, as rank_environment() gives torchrun's."""
    import threading

    from dspatch import _runtime

    if os.environ.get("DSPATCH_RANKS", "fork") == "torchrun":
        return "DSPATCH_RANKS=torchrun"
    if not hasattr(os, "fork") or sys.platform != "linux":
        return "no fork() here"
    if threading.active_count() > 1:
        return "this process runs Python threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return "this process is in a process group"
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and getattr(comm, "cdb", None) is not None:
        return "this process initialized deepspeed.comm"
    state = sys.modules.get("accelerate.state")
    if state is not None and any(getattr(getattr(state, name, None), "_shared_state", None)
                                 for name in ("PartialState", "AcceleratorState")):
        return "this process holds accelerate's state"
    if any(_runtime.state.applied[pid].intact() is False for pid in _runtime.applied_ids()):
        return "a patch here is no longer whole"
    return None


def _forked(module, folder, args, nproc, timeout):
    """The job's ranks as children of this process: (exit code, stdout, stderr) as torchrun's would be (the first
    failing rank's code; the others stopped, as torchrun stops them)."""
    import signal
    import tempfile
    import time

    from dspatch import _runtime

    env, port = rank_environment(), _free_port()
    leave_out = [pid for pid in _runtime.applied_ids() if pid not in env.get("DSPATCH", "").split(",")]
    logs = [tempfile.TemporaryFile("w+b") for _ in range(nproc)]
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            code = 1
            try:
                code = _be_rank(module, [folder, *args], {**env, **_rendezvous(rank, nproc, port)}, folder,
                                logs[rank].fileno(), leave_out)
            finally:
                os._exit(code)
        children.append(pid)
    codes, deadline = {}, time.monotonic() + timeout
    while len(codes) < nproc:
        for pid in children:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        failed = [c for c in codes.values() if c != 0]
        if (failed or time.monotonic() > deadline) and len(codes) < nproc:
            time.sleep(1 if failed else 0)  # a failing rank's peers get a moment to write their own error
            for pid in children:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -9
        time.sleep(0.02)
    stderr = []
    for rank, log in enumerate(logs):
        log.seek(0)
        stderr.append(log.read().decode("utf-8", "replace"))
        log.close()
    code = next((c for c in (codes[p] for p in children) if c != 0), 0)
    return code, "", "".join(stderr)


def _be_rank(module, argv, env, folder, log_fd, leave_out):
    """In a forked child: become rank `env["RANK"]` of the job, `python -m module ARGV` in `folder`."""
    import runpy
    import traceback

    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(folder)
    if leave_out:
        import dspatch

        dspatch.revert(leave_out, force=True)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)  # OMP_NUM_THREADS=1 for torchrun's ranks: read by torch at its import only
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        # what atexit does in a fresh rank; this one leaves with os._exit, since the exit handlers it inherited are
        # the parent's, not its own
        leave_distributed()
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def finish_rank(folder, result):
    """The end of a launched rank: its result written for launch_ranks, then leave_and_exit(0)."""
    import json

    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(folder, f"rank{rank}.json.part"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(folder, f"rank{rank}.json.part"), os.path.join(folder, f"rank{rank}.json"))
    leave_and_exit(0)


def leave_and_exit(code):
    """The end of a finished rank: every rank leaves gloo together (one rank leaving while another still works takes
    gloo down), then the process exits at once with `code` (gloo's teardown can abort a finished process under
    load: "terminate called without an active exception")."""
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tiny_llama(head="LlamaForCausalLM", seed=0, **config):
    """A tiny Llama built from a config (hidden 32, 2 layers, 4 heads, vocabulary 64 unless `config` says
    otherwise), its weights drawn after torch.manual_seed(seed); `seed=None` leaves the generator alone."""
    import torch
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    shape.update(config)
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, head)(transformers.LlamaConfig(**shape))


def lm_rows(count, length, seed=3):
    """`count` causal-LM examples of `length` token ids drawn from 4-63 (labels = the ids), the same for a seed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(4, 64, (count, length), generator=generator).tolist()]


def gathered_whole(named):
    """{name: a copy of the whole tensor} for (name, parameter) pairs of a model, gathered from the ZeRO-3
    partitions (a collective: every rank) one parameter at a time, so that it does not depend on the very bug
    deepspeed/zero3-gather-waits-all fixes: a gather of several at once returns early on gloo before 0.19.8.
    Parameters that are not ZeRO-3's are copied as they are."""
    import deepspeed

    whole = {}
    for name, param in named:
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            whole[name] = param.detach().clone()
    return whole


def train_with_deepspeed(trainer, error, reword):
    """trainer.train() of a Trainer that must run DeepSpeed (it is an error if it does not); `error` raised by
    the training is raised as reword(it); accelerate's state is reset after, whatever happens."""
    if not trainer.is_deepspeed_enabled:
        raise AssertionError("the Trainer did not use DeepSpeed")
    try:
        trainer.train()
    except error as e:
        raise reword(e) from e
    finally:
        reset_accelerate()


def sgd_trainer(model, rows, deepspeed, batch, accumulation, steps, lr=0.5, max_grad_norm=1e9, **arguments):
    """trainer.train() of a real Trainer with plain SGD at a constant rate and no effective clipping unless
    `max_grad_norm` says (an update is the gradient itself), logging grad_norm at every optimizer step: for the silent
    gradient bugs, proven by numbers.
    `deepspeed` is its DeepSpeed config, or None for the same run without DeepSpeed (on the CPU). Returns (the
    trainer, the grad_norm of each step); accelerate's state is reset before and after. `arguments`: more
    TrainingArguments (bf16=True, say)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    reset_accelerate()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                                 max_steps=steps, optim="sgd", learning_rate=lr, lr_scheduler_type="constant",
                                 max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="no", report_to=[],
                                 deepspeed=deepspeed, use_cpu=deepspeed is None, dataloader_num_workers=0, seed=0,
                                 data_seed=0, **arguments)
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        if trainer.is_deepspeed_enabled != (deepspeed is not None):
            raise AssertionError(f"the Trainer's DeepSpeed: {trainer.is_deepspeed_enabled}, wanted {deepspeed}")
        try:
            trainer.train()
        finally:
            reset_accelerate()
    norms = [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry]
    if len(norms) != steps and max_grad_norm:  # with no clipping some releases compute (and log) no norm
        raise AssertionError(f"logged grad_norm {norms}, wanted {steps} steps")
    return trainer, norms


def lm_batches(count, length=8, seed=3):
    """lm_rows(count, length, seed) as micro-batches of one example each (tensors of shape [1, length])."""
    import torch

    return [{"input_ids": torch.tensor([row["input_ids"]]), "labels": torch.tensor([row["labels"]])}
            for row in lm_rows(count, length, seed)]


def lm_loss(model, batch):
    """The model's own loss on a micro-batch with labels."""
    return model(**batch).loss


def weights(model):
    """{name: a copy of the parameter} of a model, as it holds them (ZeRO-3 partitions: see gathered_whole)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def worst(got, want):
    """The largest relative difference (norm of the difference over the norm) between two sets of weights."""
    return max(float((got[name] - want[name]).norm() / want[name].norm()) for name in want)


def digest(named_weights):
    """A hash of a set of weights' bytes, in order: equal only where the weights are bit-identical."""
    import hashlib

    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in named_weights.values())).hexdigest()


def windows(micro_batches, accumulation, divisor=None):
    """`micro_batches` cut into accumulation windows, each micro-batch paired with the number its loss is divided by:
    `divisor(position in the window)`, `accumulation` where None is given; a divisor of None leaves that micro-batch
    out (as a bug that drops it does)."""
    steps = []
    for start in range(0, len(micro_batches), accumulation):
        window = []
        for position, batch in enumerate(micro_batches[start:start + accumulation]):
            by = divisor(position) if divisor else accumulation
            if by is not None:
                window.append((batch, by))
        steps.append(window)
    return steps


def sgd_windows(model, steps, lr, loss_of=lm_loss):
    """`model`'s weights after one plain-torch SGD step per window of `steps` (lists of (micro-batch, divisor), see
    windows()): each `loss_of(model, micro-batch) / divisor` back-propagated, then the step. The reference of the
    silent gradient bugs' reproducers: a bug's shape is the same steps with other windows or divisors."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for window in steps:
        for batch, by in window:
            (loss_of(model, batch) / by).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def word_tokenizer(vocab, folder=None, **special):
    """A fast tokenizer made in code (nothing from a hub): one token per whitespace-separated word of `vocab`
    (a list or {word: id}), `special` its special tokens (pad_token="<pad>", ...; padding_side too). Saved to
    `folder` when given, as trainers that reload their tokenizer need."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = vocab if isinstance(vocab, dict) else {word: i for i, word in enumerate(vocab)}
    unk = special.get("unk_token", special.get("pad_token"))
    backend = Tokenizer(models.WordLevel(ids, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    if folder is not None:
        tokenizer.save_pretrained(folder)
    return tokenizer
