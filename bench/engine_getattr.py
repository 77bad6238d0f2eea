"""What deepspeed/engine-module-hint costs on DeepSpeedEngine's attribute pass-through, against stock, in one run.

    .nox/old/bin/python bench/engine_getattr.py [--quick]

Builds a GPT-2 shaped engine (CPU, real deepspeed.initialize), then times, in alternating rounds with the patch
applied (dspatch.apply) and reverted (stock):
- pass-through hits: `engine.transformer`, `engine.generation_config`, `engine.get_input_embeddings` (a
  submodule, an attribute and a method of the model, none the engine's own): these run
  `DeepSpeedEngine.__getattr__` and succeed; the target is within 5% of stock;
- a miss, `getattr(engine, "nope", None)`: the only path the patch changes (it builds the longer message);
- `engine.module`, which never reaches `__getattr__` (a control: the same in both).
Stock and patched are timed back to back for each case in every round (order alternating); the ratio is the
median over rounds of patched / stock. The last line is JSON.
"""
import json
import os
import statistics
import sys
import time

PID = "deepspeed/engine-module-hint"
QUICK = "--quick" in sys.argv


def per_call(fn, seconds):
    """Mean seconds per call of fn over a batch sized to take about `seconds`."""
    n, t0 = 1, time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(10, int(seconds / one))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main():
    os.environ.pop("DSPATCH", None)  # stock unless this script applies it
    import dspatch
    from dspatch import _runtime

    from dspatch.patches.deepspeed.engine_module_hint.reproducers import engine_for, gpt2_model

    engine = engine_for(gpt2_model())
    import torch

    torch.set_num_threads(1)
    cases = {
        "engine.transformer (pass-through hit: submodule)": lambda: engine.transformer,
        "engine.generation_config (pass-through hit: attribute)": lambda: engine.generation_config,
        "engine.get_input_embeddings (pass-through hit: method)": lambda: engine.get_input_embeddings,
        "getattr(engine, 'nope', None) (miss)": lambda: getattr(engine, "nope", None),
        "engine.module (no __getattr__, control)": lambda: engine.module,
    }

    def use(form):
        if form == "patched":
            verdict = dspatch.apply([PID], strict=True)[PID][0]
            assert verdict == "applied", verdict
        else:
            dspatch.revert()
            assert PID not in _runtime.applied_ids()
        try:
            engine.model
        except AttributeError as e:  # the form really is what it says
            assert ("engine.module" in str(e)) == (form == "patched"), (form, str(e))

    rounds, seconds = (5, 0.02) if QUICK else (21, 0.1)
    times = {(case, form): [] for case in cases for form in ("stock", "patched")}
    ratios = {case: [] for case in cases}
    for r in range(rounds):
        for case, fn in cases.items():
            # stock and patched measured back to back (order alternating): drift in machine load hits both
            pair = {}
            for form in (("stock", "patched") if r % 2 == 0 else ("patched", "stock")):
                use(form)
                pair[form] = per_call(fn, seconds)
                times[(case, form)].append(pair[form])
            ratios[case].append(pair["patched"] / pair["stock"])
    dspatch.revert()
    import deepspeed

    print(f"deepspeed {deepspeed.__version__}, python {sys.version.split()[0]}, {rounds} rounds; per lookup: "
          f"median over rounds; ratio: median of the back-to-back patched/stock pairs")
    result = {}
    for case in cases:
        stock, patched = statistics.median(times[(case, "stock")]), statistics.median(times[(case, "patched")])
        ratio = statistics.median(ratios[case])
        result[case] = {"stock_us": round(stock * 1e6, 3), "patched_us": round(patched * 1e6, 3),
                        "ratio": round(ratio, 4)}
        print(f"  {case:<56} stock {stock * 1e6:9.3f} us   patched {patched * 1e6:9.3f} us   x{ratio:.3f}")
    hits = [ratio for case in cases if "hit" in case for ratio in ratios[case]]
    pooled = statistics.median(hits)
    opcodes = {form: (use(form), opcodes_in_getattr(engine, "transformer"))[1] for form in ("stock", "patched")}
    dspatch.revert()
    print(f"pass-through hits, patched / stock: x{pooled:.3f} (median of all {len(hits)} pairs; target within 5%: "
          f"{'met' if abs(pooled - 1) <= 0.05 else 'NOT met'})")
    print(f"bytecode instructions DeepSpeedEngine.__getattr__ executes for one hit: stock {opcodes['stock']}, "
          f"patched {opcodes['patched']}")
    print(json.dumps({"deepspeed": deepspeed.__version__, "cases": result, "hit_ratio": round(pooled, 4),
                      "target_met": abs(pooled - 1) <= 0.05, "hit_opcodes": opcodes}))


def opcodes_in_getattr(engine, name):
    """How many bytecode instructions DeepSpeedEngine.__getattr__'s own frames execute for engine.<name>."""
    import sys as _sys

    count = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_name != "__getattr__" or not frame.f_code.co_filename.endswith("runtime/engine.py"):
            return None
        frame.f_trace_opcodes, frame.f_trace_lines = True, False

        def local(frame, event, arg):
            if event == "opcode":
                count[0] += 1
            return local

        return local

    _sys.settrace(tracer)
    try:
        getattr(engine, name)
    finally:
        _sys.settrace(None)
    return count[0]

if __name__ == "__main__":
    main()
