"""deepspeed/zero3-trace-invalidation beyond the shared proofs (tests/test_proofs.py): it composes with the patches
that touch the same registration (deepspeed/zero3-module-id on <= 0.16.3, trl/zero3-generation-hooks on trl < 0.16
with deepspeed >= 0.16.4), trl's own generation path fails on stock wherever trl does not invalidate the trace
itself (trl < 1.5), and the PPO trainer's second update after generation works."""
import json

import pytest
from packaging.version import Version

from dspatch import gating, registry
from dspatch import upstream

from conftest import clean_env, run_python, skip_unless_applies, verify

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-trace-invalidation"
PATCH = registry.all_patches()[PID]
DEQUE = "IndexError: pop from an empty deque"


def _applies():
    skip_unless_applies(PID)


def _trl():
    return Version(upstream.installed_version("trl") or "0")


def test_every_patch_active_together():
    """DSPATCH=1, as users run it: with zero3-module-id rebuilding the same registration function (<= 0.16.3) or
    with trl's generation-hooks fix calling it by its new name, both scenarios train on unchanged."""
    _applies()
    outcome = verify(PID, clean_env(DSPATCH="1"))
    assert outcome["results"] == dict.fromkeys(PATCH.scenarios, "ok"), outcome
    others = {"deepspeed/zero3-module-id", "trl/zero3-generation-hooks"}
    together = [pid for pid in others if gating.evaluate(registry.all_patches()[pid]).verdict == gating.APPLIES]
    assert set(together) <= set(outcome["applied"]) and PID in outcome["applied"], outcome["applied"]


def test_trls_own_path_fails_on_stock_where_trl_does_not_invalidate():
    """trl < 1.5 re-registers the hooks without invalidating the trace: stock fails there through trl's own
    unwrap_model_for_generation too (trl >= 1.5, and so the mid stack's 1.12, passes on stock)."""
    _applies()
    stock = verify(PID, clean_env())["results"]["generation_through_trls_unwrap"]
    if _trl() < Version("1.5"):
        assert stock.startswith("bug: ") and DEQUE in stock, stock
    else:
        assert stock == "ok", stock


def test_ppo_trains_on_after_its_generation():
    """trl's PPO trainer (trl < 1.5 only: later ones invalidate themselves) generates through `.policy` between its
    updates: its second update fails on the trace (with trl's own generation-hooks bug out of the way), and the
    patch lets it through; run with the PPO save patch's reproducer (2 updates, gathered generation)."""
    _applies()
    ppo = registry.all_patches()["trl/ppo-deepspeed-save"]
    if _trl() >= Version("1.5") or gating.evaluate(ppo).verdict != gating.APPLIES:
        pytest.skip("trl >= 1.5 invalidates the trace itself, or no PPO trainer here")
    hooks = "trl/zero3-generation-hooks"
    needed = [ppo.id] + ([hooks] if gating.evaluate(registry.all_patches()[hooks]).verdict == gating.APPLIES else [])
    runs = {}
    for label, ids in (("without", needed), ("with", needed + [PID])):
        proc = run_python(["-m", "dspatch.verify", ppo.id, "--only", "zero3_save"], env=clean_env(DSPATCH=",".join(ids)),
                          warm="stack")
        runs[label] = json.loads(proc.stdout.strip().splitlines()[-1])["results"]["zero3_save"]
    assert runs["without"].startswith("error: IndexError: pop from an empty deque"), runs["without"][:500]
    assert runs["with"] == "ok", runs["with"][:2000]
