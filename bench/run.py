"""dspatch benchmarks: every figure is a ratio against a baseline measured in the same run.

    nox -s bench                       (or: python bench/run.py in an environment with dspatch + a stack)
    python bench/run.py --only=import  (--quick: fewer runs; --only=startup,import,steps,offload: those parts)

1. start-up: `python -c pass` in a fresh venv without dspatch, and in one with the dspatch wheel installed,
   DSPATCH unset and DSPATCH=1 (interleaved runs); plus what DSPATCH=1 imports, from -X importtime.
2. importing what a training script imports (deepspeed, transformers, the Trainer, accelerate, trl, peft) with
   DSPATCH=1 against unset, with dspatch's cache of computed results warm and cold (emptied before each run);
   and `python -m dspatch.apply --check` against `python -c "import deepspeed"`, cache warm and cold.
3. ZeRO-3 training steps with DSPATCH=1 against stock (bench/zero3_steps.py, alternating runs): wall time
   with a bootstrap interval, and Python opcodes per step (exact); fails when a target is not in force. The same
   for ZeRO-2 steps with the optimizer offloaded to the CPU (part "offload").
4. `dspatch explain` on a 100 MB training log with one traceback in it (bench/explain_log.py) against
   `grep -cE 'Error|Traceback'` on the same file, and explain's peak memory; and on a 400 MB one, its memory.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = "--quick" in sys.argv


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("DSPATCH")}
    e.update(extra)
    return e


def wall(cmd, environ, runs):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, env=environ, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
        times.append(time.perf_counter() - t)
    return times


def startup():
    tmp = tempfile.mkdtemp(prefix="dspatch-bench-")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, ROOT], check=True)
    wheel = [f for f in os.listdir(tmp) if f.endswith(".whl")][0]
    pythons = {}
    for name in ("without", "with"):
        subprocess.run([sys.executable, "-m", "venv", os.path.join(tmp, name)], check=True)
        pythons[name] = os.path.join(tmp, name, "bin", "python")
    subprocess.run([pythons["with"], "-m", "pip", "install", "-q", os.path.join(tmp, wheel)], check=True)
    subprocess.run([pythons["without"], "-m", "pip", "install", "-q", "wrapt>=2.5", "packaging"], check=True)
    cases = {"not installed": (pythons["without"], env()), "installed, DSPATCH unset": (pythons["with"], env()),
             "installed, DSPATCH=1": (pythons["with"], env(DSPATCH="1"))}
    runs = 20 if QUICK else 150
    samples = {k: [] for k in cases}
    for _ in range(runs):  # interleaved, so drift in machine load hits every case alike
        for k, (python, e) in cases.items():
            samples[k] += wall([python, "-c", "pass"], e, 1)
    base, base_min = statistics.median(samples["not installed"]), min(samples["not installed"])
    print(f"\n1. start-up, `python -c pass`, {runs} interleaved runs each (median, and minimum: less noisy)")
    for k, v in samples.items():
        m = statistics.median(v)
        print(f"   {k:<28} median {m * 1e3:6.2f} ms  x{m / base:.3f} (+{(m - base) * 1e3:.2f} ms)   "
              f"min {min(v) * 1e3:6.2f} ms (+{(min(v) - base_min) * 1e3:.2f} ms)")
    # What DSPATCH=1 itself imports at start-up, from the interpreter's own import timer.
    costs = []
    for _ in range(runs // 5):
        err = subprocess.run([pythons["with"], "-X", "importtime", "-c", "pass"], env=env(DSPATCH="1"),
                             check=True, capture_output=True, text=True, cwd="/").stderr
        # lines "import time: self | cumulative | name"; the top dspatch import is the least indented one
        rows = [line.split("|") for line in err.splitlines() if line.startswith("import time:") and "dspatch" in line]
        top = min(rows, key=lambda r: len(r[2]) - len(r[2].lstrip()))
        costs.append(int(top[1]) / 1e6)
    print(f"   DSPATCH=1 imports at start-up (-X importtime, cumulative): {statistics.median(costs) * 1e3:.2f} ms")


STACK_IMPORT = "import deepspeed, transformers, transformers.trainer, accelerate, trl, peft"


def import_and_check():
    """The stack's import with DSPATCH=1 against unset, and --check against `import deepspeed`, each with the
    cache warm and cold, interleaved runs (XDG_CACHE_HOME: one folder for the warm cases, another, emptied right
    before each run, for the cold ones)."""
    import shutil

    runs = 5 if QUICK else 9
    # two cache folders: the warm cases' is never emptied; the cold cases' is emptied before each of their runs
    # (one folder for both would leave the warm cases what the last cold --check computed: a cache half cold)
    warm, cold_cache = (tempfile.mkdtemp(prefix=f"dspatch-bench-{n}-") for n in ("warm", "cold"))
    computed = os.path.join(cold_cache, "dspatch", "computed")
    base, cold = env(XDG_CACHE_HOME=warm), env(XDG_CACHE_HOME=cold_cache)
    cases = {"import, DSPATCH unset": ([sys.executable, "-c", STACK_IMPORT], base, False),
             "import, DSPATCH=1, cache warm": ([sys.executable, "-c", STACK_IMPORT], {**base, "DSPATCH": "1"}, False),
             "import, DSPATCH=1, cache cold": ([sys.executable, "-c", STACK_IMPORT], {**cold, "DSPATCH": "1"}, True),
             "import deepspeed": ([sys.executable, "-c", "import deepspeed"], base, False),
             "--check, cache warm": ([sys.executable, "-m", "dspatch.apply", "--check"], base, False),
             "--check, cache cold": ([sys.executable, "-m", "dspatch.apply", "--check"], cold, True)}
    for cmd, e, _ in cases.values():  # warm every file cache of the OS, and dspatch's
        wall(cmd, e, 1)
    samples = {k: [] for k in cases}
    for _ in range(runs):
        for name, (cmd, e, empty) in cases.items():
            if empty:
                shutil.rmtree(computed, ignore_errors=True)
            samples[name] += wall(cmd, e, 1)
    m = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\n2. importing the stack ({STACK_IMPORT[7:]}) and --check, medians of {runs} interleaved runs")
    for name in cases:
        print(f"   {name:<32} {m[name] * 1e3:7.0f} ms")
    unset = m["import, DSPATCH unset"]
    for state in ("warm", "cold"):
        print(f"   DSPATCH=1 against unset, cache {state}: x{m[f'import, DSPATCH=1, cache {state}'] / unset:.3f}")
    for state in ("warm", "cold"):
        print(f"   --check against `import deepspeed`, cache {state}: "
              f"{100 * m[f'--check, cache {state}'] / m['import deepspeed']:.1f}%")
    for folder in (warm, cold_cache):
        shutil.rmtree(folder, ignore_errors=True)


def ratio_interval(stock, patched, draws=2000):
    """Ratio of medians (patched / stock) and its 95% bootstrap interval over the per-run figures."""
    import random

    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(patched, k=len(patched))) /
                    statistics.median(rng.choices(stock, k=len(stock))) for _ in range(draws))
    return statistics.median(patched) / statistics.median(stock), ratios[int(0.025 * draws)], ratios[int(0.975 * draws)]


def steps(workload="zero3"):
    """ZeRO-3 steps (or ZeRO-2 with the optimizer offloaded), stock against DSPATCH=1: wall time over alternating runs
    (with the interval that says what this machine can resolve), and Python opcodes per step (deterministic: resolves
    any difference). Exits 1 when DSPATCH=1 did not put every target of a patch that applies in force."""
    rounds = 3 if QUICK else 10
    script = os.path.join(ROOT, "bench", "zero3_steps.py")
    results = {"stock": [], "DSPATCH=1": []}
    for _ in range(rounds):  # alternate stock and patched runs
        for label, e in (("stock", env(PYTHONHASHSEED="0")), ("DSPATCH=1", env(DSPATCH="1", PYTHONHASHSEED="0"))):
            out = subprocess.run([sys.executable, script, "10" if QUICK else "40", workload], env=e, check=True,
                                 capture_output=True, text=True, cwd="/").stdout
            results[label].append(json.loads(out.strip().splitlines()[-1]))
    stock = [r["step_s"] for r in results["stock"]]
    patched = [r["step_s"] for r in results["DSPATCH=1"]]
    applied = results["DSPATCH=1"][0]["applied"]
    same = all(r["losses"] == results["stock"][0]["losses"] for r in results["stock"] + results["DSPATCH=1"])
    ratio, low, high = ratio_interval(stock, patched)
    name = "ZeRO-2 with the optimizer offloaded" if workload == "zero2-offload" else "ZeRO-3"
    print(f"\n3. {name} training step (tiny Llama, CPU), {rounds} alternating runs each (per-run medians)")
    print(f"   wall: stock {statistics.median(stock) * 1e3:.2f} ms, DSPATCH=1 {statistics.median(patched) * 1e3:.2f} ms: "
          f"x{ratio:.4f}, 95% interval x{low:.3f} to x{high:.3f} (what this machine resolves)")
    ops_stock = [r["opcodes_per_step"] for r in results["stock"]]
    ops_patched = [r["opcodes_per_step"] for r in results["DSPATCH=1"]]
    o_s, o_p = statistics.median(ops_stock), statistics.median(ops_patched)
    print(f"   Python opcodes per step: stock {o_s:.0f} ({min(ops_stock):.0f}-{max(ops_stock):.0f}), DSPATCH=1 "
          f"{o_p:.0f} ({min(ops_patched):.0f}-{max(ops_patched):.0f}): x{o_p / o_s:.6f}; stock against stock "
          f"differs by up to {(max(ops_stock) - min(ops_stock)) / o_s * 100:.4f}%")
    print(f"   applied {applied} (targets changed and in force / targets); losses bit-identical to stock in every "
          f"run: {same}")
    from dspatch import gating, registry

    # the patches of what this job imports (deepspeed, accelerate); the Trainer's and trl's are not on its path
    expected = [pid for pid, patch in registry.all_patches().items() if gating.evaluate(patch).verdict == gating.APPLIES
                and patch.distribution in ("deepspeed", "accelerate")]
    missed = [pid for pid in expected if applied.get(pid, [0, 1])[0] != applied.get(pid, [0, 1])[1]]
    if missed or not same:
        print(f"   FAILED: not every target in force for {missed}" if missed else "   FAILED: losses differ")
        sys.exit(1)


def explain_speed():
    print("4. dspatch explain on a long training log with one traceback, against grep on the same file")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import explain_log

    with tempfile.TemporaryDirectory() as folder:
        for megabytes in (100, 400):
            log = os.path.join(folder, f"job{megabytes}.log")
            explain_log.write(log, megabytes)
            grep = statistics.median(wall(["grep", "-cE", "Error|Traceback", log], env(), 3))
            code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
                    f"p = subprocess.run([sys.executable, '-m', 'dspatch.explain', '--json', {log!r}], "
                    "capture_output=True); print(time.perf_counter() - t, p.returncode, "
                    "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
            runs = [subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True,
                                   check=True).stdout.split() for _ in range(1 if QUICK or megabytes > 100 else 3)]
            seconds = statistics.median(float(r[0]) for r in runs)
            assert all(r[1] == "0" for r in runs), runs  # the traceback is named
            peak = max(int(r[2]) for r in runs) / 1024
            print(f"   {megabytes} MB: grep {grep:.2f} s; explain {seconds:.2f} s: x{seconds / grep:.1f}; "
                  f"explain's peak memory {peak:.0f} MB")


if __name__ == "__main__":
    PARTS = {"startup": startup, "import": import_and_check, "steps": steps,
             "offload": lambda: steps("zero2-offload"), "explain": explain_speed}
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), list(PARTS))
    for part in only:
        PARTS[part]()
