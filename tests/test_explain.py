"""dspatch.explain without a stack: how logs are read, what is printed, exit codes. That each patch is named from
the real traceback its stock reproducers produce is proven per stack in test_proofs.py."""
import json
import re

import pytest

from dspatch import explain, registry

from conftest import clean_env, run_python

pytestmark = pytest.mark.unit_only

FROZEN = ("Traceback (most recent call last):\n"
          '  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 3301, in _get_zero_frozen_'
          "param_attributes\n"
          '    raise ValueError(f"failed to find frozen {param} in named params")\n'
          "ValueError: failed to find frozen Parameter containing:\n"
          "tensor([[0.2500, 0.2500]], requires_grad=False) in named params\n")


def _run(text, *args, env=None):
    return run_python(["-m", "dspatch.explain", *args, "-"], env=env or clean_env(), check=False, input=text)


def test_cleaning_removes_colour_progress_redraws_and_rank_prefixes():
    raw = ("\x1b[31m[rank1]:\x1b[0m ValueError: boom\n"
           "[rank0]:[rank0]: Traceback (most recent call last):\n"
           "[default1]: KeyError: 'x'\n"
           "rank3: AssertionError: y\n"
           "  5%|5         | 1/20 [00:01<00:19]\r 10%|#         | 2/20 [00:02<00:18]\r\n"
           "12: RuntimeError: z")
    assert list(explain.clean_lines(raw)) == ["ValueError: boom", "Traceback (most recent call last):",
                                             "KeyError: 'x'", "AssertionError: y",
                                             " 10%|#         | 2/20 [00:02<00:18]", "RuntimeError: z"]


def test_a_signature_of_several_lines_must_match_in_order():
    class Fake:
        signatures = (("first", "second"),)

    assert explain.find(["x", "first", "y", "second"], [Fake()])[0][1:] == (4, "second")
    assert explain.find(["second", "first"], [Fake()]) == []


def test_the_log_names_the_bug_and_says_what_to_do():
    proc = _run(FROZEN)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("deepspeed/frozen-param-names: ")
    assert out[1] == "  seen at line 4: ValueError: failed to find frozen Parameter containing:"
    assert out[2].startswith("  here: not installed (deepspeed is not installed)")
    assert out[3] == "  do: open upstream, see https://github.com/deepspeedai/DeepSpeed/issues/6620"


def test_json_output_and_a_noisy_interleaved_log():
    noisy = "\n".join(f"\x1b[33m[rank{n % 2}]:\x1b[0m {line}"[:120] for n, line in enumerate(FROZEN.splitlines()))
    proc = _run("[rank0]: step 1 loss 2.3\n" + noisy + "\n[rank1]: Traceback (most rec", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [bug["id"] for bug in report["bugs"]] == ["deepspeed/frozen-param-names"]
    assert report["bugs"][0]["line"] == 5 and report["lines"] == 7


def test_a_log_with_no_known_bug_says_so_and_exits_1():
    proc = _run("step 1 loss 2.3\nRuntimeError: CUDA out of memory\n")
    assert proc.returncode == 1 and proc.stdout.startswith("No known bug found in 2 lines of standard input.")
    assert "deepspeed/frozen-param-names" in proc.stdout


def test_nothing_in_the_log_is_executed(tmp_path):
    marker = tmp_path / "ran"
    log = (f"__import__('os').system('touch {marker}')\n{{{{ exec('open({str(marker)!r}, \"w\")') }}}}\n"
           f"import sitecustomize_evil\n" + FROZEN)
    assert _run(log).returncode == 0
    assert not marker.exists()


def test_unreadable_log_is_one_line_and_exit_2(tmp_path):
    proc = run_python(["-m", "dspatch.explain", str(tmp_path / "missing.log")], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"dspatch.explain: cannot read {tmp_path / 'missing.log'}: No such file or directory"


def test_empty_input_and_binary_garbage_are_read_not_crashed_on(tmp_path):
    assert _run("").returncode == 1
    log = tmp_path / "job.log"
    log.write_bytes(b"\xff\xfe\x00\x01 garbage\n\x1b[1mValueError: failed to find frozen x\xff\n")
    proc = run_python(["-m", "dspatch.explain", str(log)], check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("deepspeed/frozen-param-names: "), proc.stderr


def test_every_signature_compiles():
    patches = list(registry.all_patches().values())
    for patch in patches:
        for signature in patch.signatures:
            parts = signature if isinstance(signature, tuple) else (signature,)
            for part in parts:
                re.compile(part)


def test_active_when_dspatch_selects_it_here():
    patch = registry.all_patches()["deepspeed/frozen-param-names"]
    assert explain.advice(patch, {"DSPATCH": "deepspeed"})[2] is True
    assert explain.advice(patch, {"DSPATCH": "deepspeed/zero3-module-id"})[2] is False
    assert explain.advice(patch, {"DSPATCH": "bogus"})[2] is False
    assert explain.advice(patch, {})[2] is False
