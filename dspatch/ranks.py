"""Reproducers across ranks: `launch_ranks` runs a module as N ranks (forked from this process, where it can, else
torchrun), `rank_environment` and `settle` prepare a process for DeepSpeed, `finish_rank` / `leave_and_exit` end a
rank. dspatch.scenario re-exports the names reproducers import."""
import os
import socket
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


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

    The ranks are forked from this process where that starts them as torchrun would (see fork_refused): a rank's
    interpreter start and imports are most of a small job's time (2 x 8-10 s on 2 cores, against 1-3 s of work).
    Otherwise, or with DSPATCH_RANKS=torchrun, they are torchrun's fresh interpreters."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dspatch-ranks-") as folder:
        refused = fork_refused()
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
                           "--master_addr", "127.0.0.1", "--master_port", free_port(), "-m", module, folder,
                           *args], env=rank_environment(), capture_output=True, text=True, timeout=timeout,
                          cwd=folder)
    return proc.returncode, proc.stdout, proc.stderr


def fork_refused():
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

    env, port = rank_environment(), free_port()
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

