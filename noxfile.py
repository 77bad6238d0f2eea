"""Test matrix over real upstream stacks (deepspeed + transformers + accelerate + trl, torch 2.13 CPU), plus a torch-free unit session.

    nox                 lint + unit + old + bridge + mid + latest + trl_tf5 + tf444_ds16 + ds0183 + ds0182 + ds0192 +
                        ds0198 + ds0176 (what CI runs)
    nox -s demo         build the old stack, a tiny ZeRO-3 job stock vs DSPATCH=1, and `dspatch check`
    nox -s bench        start-up, --check and training-step benchmarks (ratios against a same-run baseline)
"""
import glob
import hashlib
import json
import os
import shutil
import time

import nox

nox.options.sessions = ["lint", "unit", "old", "bridge", "mid", "latest", "trl_tf5", "tf444_ds16", "ds0183", "ds0182",
                        "ds0192", "ds0198", "ds0176"]
nox.options.error_on_missing_interpreters = True

# torch first, alone: 2.13.0 is a CPU wheel from the machine's local store; installed first, no stack
# package can pull a CUDA build of torch afterwards.
TORCH = "torch==2.13.0"
STACKS = {
    # rich: trl 0.11 forgets it; msgpack, einops: the released sources of later deepspeed bands run on this stack too
    "old": ["deepspeed==0.14.4", "transformers==4.44.2", "accelerate==0.34.2", "trl==0.11.4", "peft==0.12.0", "rich",
            "msgpack", "einops"],
    # the releases of early 2025 that many projects still pin (datasets 3.x: newer ones pull a hub client that
    # this transformers cannot use)
    "bridge": ["deepspeed==0.16.9", "transformers==4.46.3", "accelerate==1.8.1", "trl==0.15.2", "peft==0.14.0",
               "datasets==3.2.0"],
    "mid": ["deepspeed==0.16.3", "transformers==4.57.6", "accelerate==1.10.1", "trl==1.12.0", "peft==0.17.1"],
    "latest": ["deepspeed==0.19.8", "transformers==5.24.0", "accelerate==1.15.0", "trl==1.16.0", "peft==0.21.2"],
}
TEST_TOOLS = ["pytest", "pytest-xdist", "hypothesis"]
# trl's last PPO trainer (1.12.0) on transformers 5.x, where its save under DeepSpeed fails at every ZeRO stage
# (trl/ppo-deepspeed-save); accelerate 1.10.1 can still run DeepSpeed with 2 CPU processes
TRL_TF5 = ["deepspeed==0.16.3", "transformers==5.23.0", "accelerate==1.10.1", "trl==1.12.0"]
# transformers 4.44.2 (the old stack's) with a deepspeed that validates its config with pydantic 2 (>= 0.15), where an
# "auto" ZeRO-3 config fails to start (transformers/deepspeed-prefetch-bucket-int): that patch's proofs only
TF444_DS16 = ["deepspeed==0.16.3", "transformers==4.44.2", "accelerate==0.34.2"]
# Sessions that prove only the patches of one deepspeed band no full stack installs (issue 35): their pins are kept
# out of the environments' folder hash below, so that adding one does not rebuild every stack's environment; a
# changed pin here reinstalls over that session's own environment (install_once's stamp tells).
# ds0183: deepspeed 0.18.3 on the mid stack's other pins, the release where the GA scaling moved into output hooks
SMALL = {"ds0183": ["deepspeed==0.18.3", "transformers==4.57.6", "accelerate==1.10.1"],
         # ds0182: the last release before that move, where ZeRO-2 kept only the last micro-batch of a window (and
         # no_sync micro-steps went undivided, as on mid and bridge)
         "ds0182": ["deepspeed==0.18.2", "transformers==4.57.6", "accelerate==1.10.1"],
         # ds0192: the one release where LoRA's fp32 adapters on a bf16 base fail ZeRO-3's coalesced all-gather, on
         # the latest stack's other pins
         "ds0192": ["deepspeed==0.19.2", "transformers==5.23.0", "accelerate==1.15.0", "peft==0.21.2"],
         # ds0198: the newest deepspeed on the mid stack's other pins, as a user who upgrades DeepSpeed alone has it
         "ds0198": ["deepspeed==0.19.8", "transformers==4.57.6", "accelerate==1.10.1"],
         # ds0176: the first release where bf16 at stage 0 runs the fp16 optimizer wrapper (PR 7515), on the mid
         # stack's other pins: loading its checkpoint fails
         "ds0176": ["deepspeed==0.17.6", "transformers==4.57.6", "accelerate==1.10.1"]}

# The stacks' environments live outside the clone (a clean clone, as CI makes, would otherwise rebuild six of them
# every run), in a folder named by a hash of everything installed into them: a changed pin is a new folder, never
# a stale environment. Only the upstream packages are kept: dspatch itself is reinstalled from this checkout every
# run. A fresh machine builds them from nothing with the same command. NOX_ENVDIR overrides the place.
_PINS = json.dumps([TORCH, STACKS, TRL_TF5, TF444_DS16, TEST_TOOLS], sort_keys=True)
ENV_ROOT = os.environ.get("DSPATCH_NOX_ENVS", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dspatch", "nox-envs"))
nox.options.envdir = os.path.join(ENV_ROOT, hashlib.sha256(_PINS.encode()).hexdigest()[:16])
nox.options.reuse_venv = "yes"


def _forget_old_environments(days=14):
    """Environments of pins not used for two weeks are removed (each is a few GB)."""
    if not os.path.isdir(ENV_ROOT):
        return
    for name in os.listdir(ENV_ROOT):
        path = os.path.join(ENV_ROOT, name)
        if path != nox.options.envdir and time.time() - os.path.getmtime(path) > days * 86400:
            shutil.rmtree(path, ignore_errors=True)


_forget_old_environments()
if os.path.isdir(nox.options.envdir):
    os.utime(nox.options.envdir)


def install_once(session, *requirements):
    """`session.install(*requirements)`, skipped where this environment already installed exactly these (a stamp
    file in it, written after pip succeeded): the environments outlive a run, and pip's start and resolution of
    pins already there cost each session 10-15 s."""
    stamp = os.path.join(session.virtualenv.location,
                         ".dspatch-installed-" + hashlib.sha256(json.dumps(requirements).encode()).hexdigest()[:16])
    if os.path.exists(stamp):
        return
    session.install(*requirements)
    with open(stamp, "w") as f:
        f.write("\n".join(requirements) + "\n")


_WHEEL = []  # the wheel of this checkout, built once per nox run, installed in every session


def install_dspatch(session, *tools):
    """dspatch as a user gets it (a wheel, with its .pth), built from this checkout afresh every run (once: the
    sessions of one run install the same wheel, 10 s each less)."""
    install_once(session, *tools)
    if not _WHEEL or not os.path.exists(_WHEEL[0]):
        import glob
        import tempfile

        folder = tempfile.mkdtemp(prefix="dspatch-wheel-")
        session.run("python", "-m", "pip", "wheel", "-q", "--no-deps", "-w", folder, ".")
        _WHEEL[:] = glob.glob(os.path.join(folder, "dspatch-*.whl"))
    session.install("--force-reinstall", "--no-deps", _WHEEL[0])
# Two workers: the tests are mostly subprocesses (fresh interpreters running deepspeed), one core each.
XDIST = ["-n", "2", "--dist", "loadfile", "--durations=15"]  # the slowest tests, to keep CI in its budget
# OMP_NUM_THREADS=1: two xdist workers on two cores, each process with torch's pool of one thread per core, had four
# threads fight for two cores (the ranks of a 2-rank job already run one thread each, as torchrun gives them). Every
# comparison is between runs under the same setting. Measured on the latest session, 2 cores: 169 s, 134 s with it.
TEST_ENV = {"DS_ACCELERATOR": "cpu", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def install_stack(session, name):
    install_once(session, TORCH)
    install_once(session, *STACKS[name])
    install_dspatch(session, "wrapt>=2.5", "packaging", *TEST_TOOLS)


@nox.session(python="3.11")
def lint(session):
    """ruff, and mypy on dspatch/ and the patch contract, as configured in pyproject.toml."""
    install_once(session, "ruff==0.17.6", "mypy==2.4.1")
    session.run("ruff", "check", ".")
    session.run("mypy")


@nox.session(python="3.11")
def unit(session):
    """Registry, selection, `dspatch check` without any target, the command line, activation cost, packaging, every
    release's verdict."""
    install_dspatch(session, "wrapt>=2.5", "packaging", *TEST_TOOLS)
    # released sdists are cached outside the clone (~/.cache/dspatch/releases unless DSPATCH_RELEASE_CACHE says
    # otherwise), so a fresh clone, as CI makes, does not download them again
    # (a patch's own test module holds its stack tests and, marked unit_only, what its released sources say)
    session.run("pytest", "-m", "not stack or unit_only", *XDIST, *session.posargs, env=TEST_ENV)


def stack_session(name):
    @nox.session(python="3.11", name=name)
    def run(session):
        install_stack(session, name)
        # the small sessions' pins: a diff band one of them proves is not run again here
        session.run("pytest", "-m", "not unit_only", *XDIST, *session.posargs,
                    env={**TEST_ENV, "DSPATCH_TEST_STACK": name, "DSPATCH_MATRIX": json.dumps(STACKS),
                         "DSPATCH_SMALL": json.dumps(SMALL),
                         "DSPATCH_PINS": json.dumps([TORCH, *STACKS[name]])})

    run.__doc__ = f"Every patch proven against real {', '.join(STACKS[name])} (torch 2.13 CPU)."
    return run


for _name in STACKS:
    globals()[_name] = stack_session(_name)

PROOFS = ["tests/test_proofs.py", "tests/test_proofs_fixes.py", "tests/test_proofs_diffs.py"]
# the folders of the patches that name a session in their Proof (proven_in, own_tests_in), read in that session
_FOLDERS_NAMING = """import json, sys
from dspatch import registry
named = [p for p in registry.all_patches().values() if sys.argv[1] in (*p.proven_in, *p.own_tests_in)]
print(json.dumps(["/".join(p.reproducers.split(".")[:-1]) for p in named]))"""


def proving_session(name, pins, doc, proofs=(*PROOFS, "tests/test_proofs_bands.py"), also=()):
    """A session outside the matrix: on `pins`, the proofs (`proofs`) and own tests of the patches whose Proof names
    this session (proven_in; own_tests_in: their own tests only), nothing else: the patches choose their sessions,
    conftest deselects every other patch's tests, and a session no patch names stops. `also`: shared test files whose
    tests of those patches belong here too."""

    @nox.session(python="3.11", name=name)
    def run(session):
        install_once(session, TORCH)
        install_once(session, *pins)
        install_dspatch(session, "wrapt>=2.5", "packaging", *TEST_TOOLS)
        folders = json.loads(session.run("python", "-c", _FOLDERS_NAMING, name, silent=True).strip().splitlines()[-1])
        # each folder's own tests, from this checkout (the wheel installed holds no tests)
        own = [folder for folder in folders if glob.glob(os.path.join(folder, "test_*.py"))]
        session.run("pytest", "-m", "not unit_only", *XDIST, *proofs, *also, *own, *session.posargs,
                    env={**TEST_ENV, "DSPATCH_TEST_STACK": name, "DSPATCH_MATRIX": json.dumps(STACKS),
                         "DSPATCH_SMALL": json.dumps(SMALL), "DSPATCH_PINS": json.dumps([TORCH, *pins])})

    run.__doc__ = f"{doc} ({', '.join(pins)}, torch 2.13 CPU)"
    return run


trl_tf5 = proving_session("trl_tf5", TRL_TF5, "trl/ppo-deepspeed-save proven against trl 1.12.0 with transformers "
                          "5.23.0: its own tests, and the monkeypatch's and the diff's proofs every patch owes",
                          proofs=PROOFS[1:])
tf444_ds16 = proving_session("tf444_ds16", TF444_DS16, "transformers/deepspeed-prefetch-bucket-int proven on "
                             "transformers 4.44.2 with deepspeed 0.16.3", proofs=PROOFS)
ds0183 = proving_session("ds0183", SMALL["ds0183"],
                         "deepspeed 0.18.3's gradient scaling in output hooks: output-hooks-gas-per-tensor, "
                         "backward-scale-wrt-gas, direct-backward-gas-per-tensor; bf16's checked skips "
                         "(static-scaler-silent-skip); bf16 at stage 0 (zero0-bf16-grads); pipelines "
                         "(pipe-grad-accum-scale); "
                         "the 0.17.2-0.18.9 band of lr-schedules-multigroup, 0.17.3-0.18.4 of "
                         "zero3-allreduce-fetch-padding, 0.18.3-0.18.4 of zero12-backward-twice; "
                         "zero3-moe-leaf-modules' own tests (the user's choices win)", also=["tests/test_canary.py"])
ds0182 = proving_session("ds0182", SMALL["ds0182"],
                         "ZeRO-2 keeping the last micro-batch (zero2-grad-accum-last-microbatch); the last release of "
                         "grad-accum-scale-no-allreduce, its other bands' newest releases; bf16 at stage 0 "
                         "(zero0-bf16-grads); the TypeError band of zero12-backward-twice", also=["tests/test_canary.py"])
ds0192 = proving_session("ds0192", SMALL["ds0192"],
                         "ZeRO-3 + LoRA's fp32 adapters on a bf16 base (zero3-lora-mixed-dtype-allgather); a gather "
                         "handle waited twice (zero3-gather-handle-waited-once); the 0.18.5-0.19.7 bands of "
                         "zero12-backward-twice; loss.backward() divided per output (direct-backward-gas-per-tensor)")
ds0198 = proving_session("ds0198", SMALL["ds0198"],
                         "deepspeed >= 0.19.3 refusing the warmup of 0 that transformers < 5.18 and accelerate < 1.15 "
                         "fill (transformers/deepspeed-warmup-zero, accelerate/deepspeed-warmup-zero); loss.backward() "
                         "divided per output (deepspeed/direct-backward-gas-per-tensor)")
ds0176 = proving_session("ds0176", SMALL["ds0176"],
                         "bf16 at stage 0 on 0.17.6: load_checkpoint fails on the ZeRO path (zero0-bf16-checkpoint)")


@nox.session(python="3.11")
def demo(session):
    """The main job: on the old stack, a tiny 2-rank ZeRO-3 mixture-of-experts job, stock then with DSPATCH=1; then
    what `dspatch check` says applies here, and why the job applied fewer. Installs what a user has: the stack and
    dspatch, no test tools."""
    install_once(session, TORCH)
    install_once(session, *STACKS["old"])
    install_dspatch(session, "wrapt>=2.5")
    env = {"DS_ACCELERATOR": "cpu"}
    job = ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
           "examples/zero3_expert_ids.py"]
    session.log("The job: a mixture-of-experts model whose 4 experts carry their own `.id` (the slot each is placed "
                "on, which routing reads), 3 ZeRO-3 steps on 2 ranks, deepspeed 0.14.4.")
    seen = {}
    for label, extra, args in (("stock", {}, []), ("DSPATCH=1", {"DSPATCH": "1"}, ["--require-fixed"])):
        out = session.run(*job, *args, env={**env, **extra}, silent=True)
        seen[label] = sorted(line for line in out.splitlines() if line.startswith("rank "))
        session.log(f"{label}:")
        for line in seen[label]:
            session.log(f"  {line}")
        if label == "stock":
            session.log("  ZeRO-3 numbered every module with `module.id`, overwriting the experts' own: code that "
                        "places or routes experts by `.id` now picks the wrong one, and nothing fails.")
    stock, patched = seen.values()
    session.log("summary: stock: " + ("ids overwritten on both ranks" if len(stock) == 2 and
                                      all("BUG" in x for x in stock) else f"{stock}"))
    session.log("         DSPATCH=1: " + ("ids kept on both ranks" if len(patched) == 2 and
                                          all("kept" in x for x in patched) else f"{patched}"))
    report = json.loads(session.run("dspatch", "check", "--json", env=env, silent=True))
    applies = [row for row in report["patches"] if row["verdict"] == "applies"]
    session.log(f"`dspatch check` here: {len(applies)} of {len(report['patches'])} patches apply to this stack:")
    for row in applies:
        session.log(f"  {row['id']} ({row['distribution']}=={row['version']})")
    session.log("The job applied only those of the packages it imports (deepspeed, accelerate): a patch is applied "
                "when its package is imported, so transformers' and trl's wait for a job that imports them.")
    bin_dir = os.path.join(session.virtualenv.location, "bin")
    session.log(f"This environment is {session.virtualenv.location}. Next, try there:")
    for command, what in (("dspatch check", "every patch's verdict here, and why"),
                          ("dspatch verify deepspeed/zero3-module-id", "its reproducers: the bug on stock, then fixed"),
                          ("dspatch explain job.log", "which known bug a failed job's log shows, and what to do"),
                          ("DSPATCH=1 python train.py", "your own job, patched (or: dspatch run train.py)")):
        session.log(f"  {what}:")
        session.log(f"    {bin_dir}/{command}" if command.startswith("dspatch") else
                    f"    {command.replace('python', bin_dir + '/python')}")


@nox.session(python="3.11")
@nox.parametrize("stack", ["old", "latest"])
def bench(session, stack):
    """Start-up, --check and ZeRO-3 step benchmarks on the old stack, the stack import and --check on latest too;
    prints ratios measured in one run."""
    install_stack(session, stack)
    parts = [] if stack == "old" else ["--only=import"]
    session.run("python", "bench/run.py", *parts, *session.posargs, env={"DS_ACCELERATOR": "cpu"})
