"""A 2-process torchrun ZeRO-3 job with DSPATCH=1: every rank applies the same patches, and on a model that
hits no bug the losses are bit-identical to a stock run."""
import json
import os
import socket

import pytest

from conftest import ROOT, clean_env, run_python

pytestmark = pytest.mark.stack


def _torchrun(out, env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_python(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(port), os.path.join(ROOT, "tests", "train_zero3.py"), str(out)], env=env)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_ranks_patched_equal_stock_bit_for_bit(tmp_path):
    from dspatch import gating, registry

    stock = _torchrun(tmp_path / "stock", clean_env())
    patched = _torchrun(tmp_path / "patched", clean_env(DSPATCH="1"))
    # every patch that applies to this stack, all active, on a job that hits none of their bugs
    # (the deepspeed ones: the job imports no Trainer, no trl)
    expected = [pid for pid, p in registry.all_patches().items()
                if p.distribution == "deepspeed" and gating.evaluate(p)[1] == gating.APPLIES]
    for s, p in zip(stock, patched):
        applied = sorted(pid for pid in p["applied"] if pid.startswith("deepspeed/"))
        assert s["applied"] == [] and applied == sorted(expected), (s["rank"], p["applied"])
        assert p["losses"] == s["losses"], f"rank {s['rank']}: patched losses differ from stock"
        assert len(set(s["losses"])) > 1  # it trained
    assert stock[0]["losses"] != stock[1]["losses"]  # ranks saw different data: two real processes
    if "deepspeed/zero3-module-id" in expected:
        assert patched[0]["module_ids"] == ["NoneType"] and stock[0]["module_ids"] == ["int"]
