"""Warm interpreters for the stack sessions: a run pays for its own work, not for `import deepspeed`.

A *zygote* is a fresh interpreter started with a run's exact environment (so `dspatch.pth` saw that DSPATCH at
interpreter start, exactly as on a user's rank) that imports the stack once, then forks one child per run. A zygote
that imports nothing dspatch watches (torch alone: mode "base", or beside a copy of upstream) starts without the
DSPATCH variables instead, and its child runs the installed `dspatch.pth` with the run's environment, as `site`
does at start-up, before anything watched is imported: one such zygote serves every DSPATCH value. The
child takes the run's argv, environment, working directory and stdin, writes its own stdout/stderr, and exits
with the status `python ARGS` would have. One zygote per distinct environment per pytest worker (at most
MAX_ZYGOTES, least recently used first out); environments with PYTHONPATH (a copy of upstream, changed by the
test between runs) always get a fresh interpreter.

Fork is safe here because the zygote does nothing but import: it refuses to serve (and every run falls back to
a fresh interpreter) if importing started a thread that is not known to survive a fork (`/proc/self/task`, see
FORK_SAFE_THREADS), since a forked child would inherit a thread pool without its threads (OpenMP). Process groups (gloo) are made in the children, never in the zygote.
tests/test_warm.py checks that a child's numbers are bit-identical to a fresh interpreter's.

What a child does not see, and so what must stay in fresh interpreters: what the zygote printed while importing
(DeepSpeed's banner, dspatch's "applied" line, import-time warnings). `run(...)` is used only for runs whose
result is their own output (dspatch.verify's JSON, a probe's "R ..." line).
"""
import json
import os
import subprocess
import sys
import tempfile
import threading

MAX_ZYGOTES = 6  # per worker; a stack zygote holds ~0.5 GB (the mid session peaks at ~4.5 GB used in all)
# what a training job on these stacks imports; each is tried (a stack may lack one, e.g. peft on trl_tf5)
BASE = ("numpy", "torch", "torch.distributed", "safetensors.torch")  # numpy first: see FORK_SAFE_THREADS
# what importing deepspeed pulls in beside torch, none of it watched by dspatch: two thirds of deepspeed's import
# time (6.5 s -> 2 s on 2 cores), which every run that imports the stack itself (mode "base", a copy of upstream)
# would otherwise pay again
BESIDE = ("torch._dynamo", "torch.distributed.tensor", "sympy", "pydantic", "requests", "huggingface_hub",
          "datasets")  # datasets (pandas, pyarrow): 2-4 s in every run that imports trl or the Trainer's data code
STACK = ("deepspeed", "transformers", "transformers.trainer", "accelerate", "peft", "trl")
# dspatch._hook.WATCHED, read the same way (this module must not import dspatch): the folders of dspatch/patches/
_PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dspatch", "patches")
WATCHED = tuple(sorted(name for name in os.listdir(_PATCHES) if not name.startswith("_")
                       and os.path.isfile(os.path.join(_PATCHES, name, "__init__.py"))))


def _lazy(env):
    """(unwatched, watched) modules a run imports late on this stack, when the file that imports them is there (in
    the run's copy of upstream, else installed): deepspeed >= 0.18's engine imports its Muon optimizer at every
    initialize, whose torch.compile decorator pulls in torch._inductor (3-4 s per run on 2 cores). Preloaded like
    the rest, so that runs pay for their own work only."""
    import importlib.util

    copies = [os.path.join(p, "deepspeed") for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    spec = importlib.util.find_spec("deepspeed")  # a top-level spec: deepspeed itself is not imported
    installed = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else ""
    folder = next((c for c in copies if os.path.isdir(c)), installed)
    if os.path.exists(os.path.join(folder, "runtime", "zero", "muon", "original_muon.py")):
        return ("torch._inductor.compile_fx",), ("deepspeed.runtime.zero.muon.muon_optimizer",)
    return (), ()
# Threads that may run when the zygote forks: OpenBLAS's pool, which numpy's import starts (OpenBLAS re-creates
# it after a fork, pthread_atfork), and jemalloc's background thread (pyarrow's allocator, started by datasets;
# jemalloc's own fork handlers). Any other thread, a Python thread or a pool started by importing (torch's
# OpenMP pool would be one), and the zygote does not serve.
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)

# The zygote's own program. It speaks JSON lines over two private descriptors; its fd 1 points at its stderr.
ZYGOTE = r'''
import json, os, sys
requests, replies = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
os.dup2(2, 1)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
def native_threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
failed, forbidden = {}, set(filter(None, sys.argv[5].split(",")))
before = None
for name in filter(None, sys.argv[3].split(",")):
    try:
        __import__(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"[:200]
    if name == "numpy":
        before = native_threads()
import threading
after = native_threads()
for name in before or ():
    after.remove(name)
threads = [name for name in after if name not in sys.argv[6].split(",")]
threads += [t.name for t in threading.enumerate() if t is not threading.main_thread()]
tainted = sorted(m for m in sys.modules if m.partition(".")[0] in forbidden)
import gc
gc.collect()
gc.freeze()  # what the zygote imported is never garbage: children's collections skip it (ZeRO-3 collects often)
sys.stdout.flush(); sys.stderr.flush()
ready = not threads and not tainted
replies.write(json.dumps({"ready": ready, "threads": threads, "failed": failed, "tainted": tainted[:5]}) + "\n")
replies.flush()
if not ready:
    sys.exit(0)
sys.path.insert(0, sys.argv[4])
import warm_child
del sys.path[0]
for line in requests:
    replies.write(json.dumps(warm_child.serve(json.loads(line), (requests.fileno(), replies.fileno()))) + "\n")
    replies.flush()
'''


class Zygote:
    def __init__(self, env, preload, forbidden):
        self.env = env
        read_req, write_req = os.pipe()
        read_rep, write_rep = os.pipe()
        here = os.path.dirname(os.path.abspath(__file__))
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(read_req), str(write_rep), ",".join(preload),
                                      here, ",".join(forbidden), ",".join(FORK_SAFE_THREADS)], env=env, cwd=tempfile.gettempdir(), pass_fds=(read_req, write_rep),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        os.close(read_req)
        os.close(write_rep)
        self.requests = os.fdopen(write_req, "w")
        self.replies = os.fdopen(read_rep, "r")
        self._stderr = []
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()
        line = self.replies.readline()
        hello = json.loads(line) if line else {"ready": False, "threads": None, "failed": {"zygote": "died"}}
        self.ready = hello["ready"]
        self.why_not = None if self.ready else f"zygote not ready: {hello} {''.join(self._stderr)[-2000:]}"

    def run(self, args, env, cwd, input, timeout, run_pth=False):
        request = {"args": list(args), "env": env, "cwd": cwd, "input": input, "timeout": timeout,
                   "run_pth": run_pth}
        self.requests.write(json.dumps(request) + "\n")
        self.requests.flush()
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"zygote died: {''.join(self._stderr)[-3000:]}")
        return json.loads(line)

    def close(self):
        try:
            self.requests.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


_zygotes = {}  # environment key -> Zygote, in order of last use
_fallbacks = []


def _key(env):
    return tuple(sorted(env.items()))


def _packages_in(path):
    """Top-level names importable from a PYTHONPATH entry."""
    try:
        names = os.listdir(path)
    except OSError:
        return set()
    return {n[:-3] if n.endswith(".py") else n for n in names
            if n.endswith(".py") or os.path.isfile(os.path.join(path, n, "__init__.py"))}


def _packages_in_all(env):
    found = set()
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        found |= _packages_in(entry)
    return found


# What dspatch reads at start-up. A zygote that preloads nothing dspatch watches starts without them, and its child
# runs dspatch.pth itself with the run's environment (what `site` would have done at the child's start: nothing
# watched is imported yet either way), so that one zygote serves every DSPATCH value (a zygote start is ~8 s).
DSPATCH_VARS = ("DSPATCH", "DSPATCH_DISABLE", "DSPATCH_STRICT", "DSPATCH_VERBOSE", "DSPATCH_CACHE")


# Read by the run, never at import: the zygote starts without them (the child has the run's whole environment), so
# that a test setting one does not start a zygote for itself.
RUN_TIME_VARS = ("DSPATCH_RANKS", "DSPATCH_NO_SYNC_RECORD")


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


def plan(env, mode="stack"):
    """(environment the zygote starts with, modules it preloads, packages it must not have imported), or None
    when this run must have a fresh interpreter.

    mode "stack": the whole stack is imported before the run (with DSPATCH on, patched there): for runs whose
    result is their own output. mode "base": only torch and what it needs, never a package dspatch watches, so
    that every import of a target and every patch decision happens in the run, as in a fresh interpreter.
    A run with PYTHONPATH (a copy of upstream) gets a zygote that never imported what the copy holds, and that
    puts PYTHONPATH on sys.path in the child, where Python would; with DSPATCH on, it preloads nothing dspatch
    watches either, so that every patch decision is made in the child, on the copy, as in a fresh run."""
    if os.environ.get("DSPATCH_WARM", "1") == "0":
        return None
    unwatched, watched = _lazy(env)
    env = _without(env, *RUN_TIME_VARS)  # what the zygote starts with: the run itself gets them
    from dspatch._hook import flag

    if mode == "stack" and flag("DSPATCH", env) and env["DSPATCH"].strip() != "1":
        # a run naming its own patches (one patch's proof): a zygote would serve it alone (~10 s to import the
        # stack, against ~4 s for the run to import it itself); the base one serves every DSPATCH value
        mode = "base"
    if mode == "base":
        return (_without(env, "PYTHONPATH", *DSPATCH_VARS), BASE + BESIDE + unwatched, tuple(WATCHED)) \
            if not _packages_in_all(env) & {"torch", "dspatch"} else None
    copies = _packages_in_all(env)
    if "torch" in copies or "dspatch" in copies:
        return None
    base = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if not copies:
        return base, BASE + STACK + unwatched + watched, ()
    forbidden = set(copies)
    if flag("DSPATCH", base):
        forbidden |= set(WATCHED)
        base = _without(base, *DSPATCH_VARS)  # nothing watched preloaded: the child runs dspatch.pth
    # a module is preloaded only if nothing forbidden is needed for it (peft and trl import transformers...)
    # (deepspeed <= 0.16 imports accelerate and transformers; the Trainer imports accelerate and peft)
    needs = {"deepspeed": {"accelerate", "transformers"}, "transformers.trainer": {"accelerate", "peft"},
             "peft": {"transformers", "accelerate"}, "trl": {"transformers", "accelerate"}}
    preload = [m for m in STACK if m.partition(".")[0] not in forbidden and not needs.get(m, set()) & forbidden]
    return base, BASE + BESIDE + unwatched + tuple(preload), tuple(sorted(forbidden))


def run(args, env, cwd, input=None, timeout=900, mode="stack"):
    """Like subprocess.run([python, *args], env=env, cwd=cwd, input=input, capture_output=True, text=True), from
    a zygote for `env` (see plan() for `mode`). Returns a subprocess.CompletedProcess, or None when no zygote can
    serve (then run it fresh)."""
    planned = plan(env, mode)
    if planned is None:
        return None
    base, preload, forbidden = planned
    key = (_key(base), preload, forbidden)
    zygote = _zygotes.pop(key, None)
    if zygote is None:
        if len(_zygotes) >= MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).close()
        zygote = Zygote(base, preload, forbidden)
        if os.environ.get("DSPATCH_WARM_LOG"):  # which environments start zygotes (CI time)
            with open(os.environ["DSPATCH_WARM_LOG"], "a") as log:
                log.write(json.dumps({"pid": os.getpid(), "mode": mode, "forbidden": forbidden, "preload": len(preload),
                                      "env": {k: v for k, v in base.items() if k.startswith("DSPATCH")}}) + "\n")
    _zygotes[key] = zygote
    if not zygote.ready:
        _fallbacks.append(zygote.why_not)
        return None
    reply = zygote.run(args, env, cwd, input, timeout, run_pth=not set(WATCHED) - set(forbidden))
    with open(reply["stdout"], encoding="utf-8", errors="replace") as out, \
            open(reply["stderr"], encoding="utf-8", errors="replace") as err:
        stdout, stderr = out.read(), err.read()
    for path in (reply["stdout"], reply["stderr"]):
        os.unlink(path)
    if reply.get("timed_out"):
        raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *args], reply["returncode"], stdout, stderr)


def close_all():
    while _zygotes:
        _zygotes.popitem()[1].close()
