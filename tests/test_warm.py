"""The warm interpreters of the stack sessions (tests/warm.py) behave as fresh ones: same numbers, bit for bit,
same exit codes, their own output; and the zygote forks only while it runs a single thread."""
import json
import os

import pytest

import warm
from conftest import STACK, clean_env, run_python

pytestmark = [pytest.mark.stack, pytest.mark.machinery("old", "latest")]  # the oldest and newest imports

# ZeRO-3 training of a tiny Llama (every process group made in the child), and what dspatch applied
TRAIN = r'''
import json, sys
import torch
from dspatch import _runtime
from dspatch.scenario import init_deepspeed, tiny_llama, zero3_config
deepspeed = init_deepspeed()
model = tiny_llama()
engine, *_ = deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
generator = torch.Generator().manual_seed(7)
losses = []
for step in range(3):
    ids = torch.randint(0, 64, (2, 8), generator=generator)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item().hex())
print("R " + json.dumps({"losses": losses, "applied": _runtime.applied_ids(), "argv": sys.argv,
                         "main": __name__, "threads_now": torch.get_num_threads()}))
'''


def _report(proc):
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("R ")][-1][2:])


@pytest.mark.parametrize("dspatch", ["", "1"])
def test_a_warm_child_trains_bit_identically_to_a_fresh_interpreter(dspatch):
    env = clean_env(DSPATCH=dspatch) if dspatch else clean_env()
    fresh = _report(run_python(["-c", TRAIN, "x"], env=env))
    warmed = _report(run_python(["-c", TRAIN, "x"], env=env, warm="stack"))
    again = _report(run_python(["-c", TRAIN, "x"], env=env, warm="stack"))  # a second child of the same zygote
    # the zygote imported the whole stack: with DSPATCH=1 it also applied what this run does not import
    applied = {name: set(report.pop("applied")) for name, report in (("fresh", fresh), ("warm", warmed),
                                                                       ("again", again))}
    assert fresh == warmed == again
    assert applied["fresh"] <= applied["warm"] == applied["again"]
    assert fresh["argv"] == ["-c", "x"] and fresh["main"] == "__main__"
    if dspatch:
        assert "deepspeed/initialize-once" in applied["fresh"], applied


def test_the_zygote_forks_single_threaded_and_children_end_as_python_does():
    env = clean_env(DSPATCH_TEST_WARM_PROBE="1")  # its own zygote
    proc = warm.run(["-c", "import sys; print(input()); print('to stderr', file=sys.stderr); sys.exit(3)"],
                    env, os.getcwd(), input="from stdin\n", timeout=120)
    assert proc is not None, warm._fallbacks
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "from stdin\n", "to stderr\n")
    failed = warm.run(["-c", "raise KeyError('boom')"], env, os.getcwd(), timeout=120)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("KeyError: 'boom'")
    module = warm.run(["-m", "json.tool"], env, os.getcwd(), input='{"a": 1}', timeout=120)
    assert module.returncode == 0 and json.loads(module.stdout) == {"a": 1}
    base, _, _ = warm.plan(env)
    zygote = next(z for key, z in warm._zygotes.items() if key[0] == warm._key(base))
    assert zygote.ready, zygote.why_not


def test_a_copy_of_upstream_is_imported_by_the_child_never_preloaded(tmp_path):
    """A run with a copy of a package on PYTHONPATH gets a zygote that never imported that package (and, with
    DSPATCH on, nothing dspatch watches): the child imports the copy."""
    copy = tmp_path / "trl"
    copy.mkdir()
    (copy / "__init__.py").write_text("WHERE = 'the copy'\n")
    code = "import trl, sys; print(trl.WHERE, 'deepspeed' in sys.modules, sys.path[1])"
    stock = warm.run(["-c", code], clean_env(PYTHONPATH=str(tmp_path)), os.getcwd())
    assert stock is not None, warm._fallbacks
    assert stock.stdout.split() == ["the", "copy", "True", str(tmp_path)], (stock.stderr, warm._fallbacks)
    patched = warm.run(["-c", code], clean_env(PYTHONPATH=str(tmp_path), DSPATCH="1"), os.getcwd())
    assert patched.stdout.split() == ["the", "copy", "False", str(tmp_path)], (patched.stderr, warm._fallbacks)
    # a copy of torch or of dspatch itself: a fresh interpreter
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    assert warm.run(["-c", "pass"], clean_env(PYTHONPATH=str(tmp_path)), os.getcwd()) is None
    assert STACK
