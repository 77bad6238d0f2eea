"""deepspeed/zero0-bf16-checkpoint beyond the shared proofs: the resumed run's weights, a stock checkpoint, and the
bf16 engines it leaves alone."""

import pytest

from conftest import clean_env, last_json, run_python, skip_unless_applies
from dspatch import registry

PID = "deepspeed/zero0-bf16-checkpoint"
GRADS = "deepspeed/zero0-bf16-grads"
pytestmark = pytest.mark.stack


def _applies():
    """Where the patch applies (ds0183, ds0182, ds0176: their proofs fail if it does not); the matrix's releases lack
    the bug."""
    skip_unless_applies(PID)


def _run(code, dspatch, *args):
    """The last line `code` prints, as JSON, run with DSPATCH=`dspatch` (None: stock) and `args` as sys.argv[1:]."""
    env = clean_env(DSPATCH=dspatch) if dspatch else clean_env()
    return last_json(run_python(["-c", code, *args], env=env, warm="stack"))


RESUMED = ("import json\n"
           "from dspatch.patches.deepspeed.zero0_bf16_checkpoint.reproducers import resumed_against_uninterrupted\n"
           "print(json.dumps([resumed_against_uninterrupted(False), resumed_against_uninterrupted(True)]))\n")


def test_with_the_bf16_gradient_fix_a_resumed_run_is_the_uninterrupted_one_to_the_bit():
    """Both halves of bf16 at stage 0 fixed (the gradients, deepspeed/zero0-bf16-grads, and the checkpoint): the run
    saved after 3 steps and resumed in a new engine for the 4th has the uninterrupted run's weights exactly; with the
    gradient fix alone (stock checkpoints) it is far off (0.77 measured on 0.18.3), or on 0.17.6 the load fails."""
    _applies()
    assert _run(RESUMED, f"{GRADS},{PID}") == [0.0, 0.0]
    from dspatch import upstream
    from dspatch.versions import SpecifierSet, Version

    if SpecifierSet(registry.all_patches()[PID].loud_on).contains(Version(upstream.installed_version("deepspeed"))):
        stock = run_python(["-c", RESUMED], env=clean_env(DSPATCH=GRADS), warm="stack", check=False)
        assert stock.returncode != 0 and "has no attribute 'dp_process_group'" in stock.stderr, stock.stderr[-2000:]
    else:
        assert min(_run(RESUMED, GRADS)) > 0.01


STOCK_SAVE = ("import json, sys\n"
              "from dspatch.patches.deepspeed.zero0_bf16_checkpoint import reproducers as r\n"
              "from dspatch.scenario import lm_batches, lm_loss\n"
              "engine = r._engine(False)\n"
              "for batch in lm_batches(2):\n"
              "    engine.backward(lm_loss(engine, batch)); engine.step()\n"
              "engine.save_checkpoint(sys.argv[1], tag='stock')\n"
              "print(json.dumps(sorted({float(s[0]) for s in r._adam_state(engine).values()})))\n")
PATCHED_LOAD = ("import json, sys\n"
                "from dspatch.patches.deepspeed.zero0_bf16_checkpoint import reproducers as r\n"
                "engine = r._engine(False)\n"
                "own = sorted({float(s[0]) for s in r._adam_state(engine).values()})\n"
                "engine.load_checkpoint(sys.argv[1], tag='stock')\n"
                "print(json.dumps([own, sorted({float(s[0]) for s in r._adam_state(engine).values()})]))\n")


def test_a_checkpoint_stock_wrote_loads_as_on_stock(tmp_path):
    """A checkpoint saved before the patch holds no optimizer state: the patched load goes on as stock's (the weights
    load, the new engine keeps its own optimizer state) instead of failing on the missing state."""
    _applies()
    folder = str(tmp_path / "ckpt")
    saved = _run(STOCK_SAVE, None, folder)
    own, loaded = _run(PATCHED_LOAD, PID, folder)
    assert saved != own and loaded == own, (saved, own, loaded)


FP32_ACCUMULATION = ("import json, os, sys, torch\n"
                  "from dspatch.scenario import init_deepspeed, lm_batches, lm_loss, tiny_llama\n"
                  "deepspeed = init_deepspeed()\n"
                  "model = tiny_llama()\n"
                  "config = {'train_micro_batch_size_per_gpu': 1, 'steps_per_print': 10**6, 'bf16': {'enabled': True},\n"
                  "          'data_types': {'grad_accum_dtype': 'fp32'}, 'zero_optimization': {'stage': 0}}\n"
                  "engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),\n"
                  "                                  config=config)\n"
                  "engine.backward(lm_loss(engine, lm_batches(1)[0])); engine.step()\n"
                  "engine.save_checkpoint(sys.argv[1], tag='t')\n"
                  "state = torch.load(os.path.join(sys.argv[1], 't', 'mp_rank_00_model_states.pt'), weights_only=False)\n"
                  "print(json.dumps([type(engine.optimizer).__name__, state['optimizer'] is None,\n"
                  "                  sorted(os.listdir(os.path.join(sys.argv[1], 't')))]))\n")


def test_fp32_gradient_accumulation_runs_the_same_wrapper_and_is_fixed_too(tmp_path):
    """bf16 with fp32 gradient accumulation at stage 0 runs the fp16 wrapper on these releases as well (measured on
    0.18.2 and 0.18.3; a BF16_Optimizer, whose state the patch leaves where stock puts it, is what a bf16 engine built
    without an optimizer gets): stock's model file holds no optimizer state, the patched one does, and nothing else
    (no ZeRO file) is written either way."""
    _applies()
    stock = _run(FP32_ACCUMULATION, None, str(tmp_path / "stock"))
    patched = _run(FP32_ACCUMULATION, PID, str(tmp_path / "patched"))
    assert stock == ["FP16_UnfusedOptimizer", True, ["mp_rank_00_model_states.pt"]], stock
    assert patched == ["FP16_UnfusedOptimizer", False, ["mp_rank_00_model_states.pt"]], patched

