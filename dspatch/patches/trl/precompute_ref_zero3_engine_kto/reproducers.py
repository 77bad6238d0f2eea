"""Reproducers: KTOTrainer's, from trl/precompute-ref-zero3-engine's (dspatch/patches/trl/precompute_ref_zero3_engine/reproducers.py).

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.patches.trl.precompute_ref_zero3_engine.reproducers import kto_precomputed_zero3
from dspatch.spec import Proof

PROOF = Proof(
    scenarios={"kto_precomputed_zero3": kto_precomputed_zero3},
    expected_on_stock={
      "kto_precomputed_zero3": "KTO with a reference precomputed in one batch at ZeRO-3: the first training forward: "
                               "IndexError: pop from an empty deque",
  },
    # The releases of trl that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("1.8.0", "1.16.0"),
)
