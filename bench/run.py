"""dspatch benchmarks: every figure is a ratio against a baseline measured in the same run.

    nox -s bench                       (or: python bench/run.py in an environment with dspatch + a stack)

1. start-up: `python -c pass` in a fresh venv without dspatch, and in one with the dspatch wheel installed,
   DSPATCH unset and DSPATCH=1 (interleaved runs, medians); plus the .pth line itself, timed in-process.
2. `python -m dspatch.apply --check` against `python -c "import deepspeed"`.
3. ZeRO-3 training step time with DSPATCH=1 against stock (bench/zero3_steps.py, alternating runs).
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
    runs = 10 if QUICK else 60
    samples = {k: [] for k in cases}
    for _ in range(runs):  # interleaved, so drift in machine load hits every case alike
        for k, (python, e) in cases.items():
            samples[k] += wall([python, "-c", "pass"], e, 1)
    base = statistics.median(samples["not installed"])
    print(f"\n1. start-up, `python -c pass`, median of {runs} interleaved runs each")
    for k, v in samples.items():
        m = statistics.median(v)
        print(f"   {k:<28} {m * 1e3:7.2f} ms   x{m / base:.3f}   (+{(m - base) * 1e3:.2f} ms)")
    # The .pth line alone, timed inside fresh interpreters: end-to-end medians are noisier than a millisecond.
    # -S keeps `site` from running it first; the probe puts site-packages on sys.path and runs it itself.
    probe = ("import os, sys, time; sys.path.append(sys.argv[2]); "  # os: site has imported it already at start-up
             "code = compile(open(sys.argv[1]).read(), 'dspatch.pth', 'exec'); "
             "t = time.perf_counter(); exec(code); print(time.perf_counter() - t)")
    site_dir = subprocess.run([pythons["with"], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    pth = os.path.join(site_dir, "dspatch.pth")
    for label, e in (("DSPATCH unset", env()), ("DSPATCH=1", env(DSPATCH="1"))):
        cost = [float(subprocess.run([pythons["with"], "-S", "-c", probe, pth, site_dir], env=e, check=True,
                                     capture_output=True, text=True, cwd="/").stdout)
                for _ in range(runs // 2)]
        print(f"   the .pth line alone, {label:<14} {statistics.median(cost) * 1e3:7.3f} ms (median, in-process)")


def check_vs_import():
    runs = 3 if QUICK else 7
    check = wall([sys.executable, "-m", "dspatch.apply", "--check"], env(), runs)
    imp = wall([sys.executable, "-c", "import deepspeed"], env(), runs)
    c, i = statistics.median(check), statistics.median(imp)
    print(f"\n2. `python -m dspatch.apply --check` {c * 1e3:.0f} ms vs `import deepspeed` {i * 1e3:.0f} ms: "
          f"{100 * c / i:.1f}% (medians of {runs})")


def steps():
    rounds = 2 if QUICK else 4
    script = os.path.join(ROOT, "bench", "zero3_steps.py")
    results = {"stock": [], "DSPATCH=1": []}
    for _ in range(rounds):  # alternate stock and patched runs
        for label, e in (("stock", env()), ("DSPATCH=1", env(DSPATCH="1"))):
            out = subprocess.run([sys.executable, script, "10" if QUICK else "40"], env=e, check=True,
                                 capture_output=True, text=True, cwd="/").stdout
            results[label].append(json.loads(out.strip().splitlines()[-1]))
    stock = statistics.median(r["step_s"] for r in results["stock"])
    patched = statistics.median(r["step_s"] for r in results["DSPATCH=1"])
    spread = max(r["step_s"] for r in results["stock"]) / min(r["step_s"] for r in results["stock"])
    applied = results["DSPATCH=1"][0]["applied"]
    same = all(r["losses"] == results["stock"][0]["losses"] for r in results["stock"] + results["DSPATCH=1"])
    print(f"\n3. ZeRO-3 training step (tiny Llama, CPU), median of {rounds} alternating runs each")
    print(f"   stock {stock * 1e3:.2f} ms/step, DSPATCH=1 {patched * 1e3:.2f} ms/step: x{patched / stock:.4f} "
          f"(stock run-to-run spread x{spread:.4f}; applied {applied}; losses bit-identical: {same})")


if __name__ == "__main__":
    startup()
    check_vs_import()
    steps()
