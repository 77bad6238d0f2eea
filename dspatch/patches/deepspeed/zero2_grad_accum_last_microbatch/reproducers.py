"""Reproducers: real deepspeed.initialize at ZeRO-2 (CPU, one process, no offload) on a tiny Llama, gradient
accumulation 3 and 4: the raw engine loop against plain torch (`dspatch canary`'s comparison), and the Trainer at ZeRO-2
against ZeRO-1 (right on every release). A silent bug, proven by numbers, with deepspeed/zero2-offload-grad-accum's
machinery (its reproducers' module documents the tolerance); here the bug's shape is the last micro-batch of each
window alone.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.patches.deepspeed.zero2_offload_grad_accum.reproducers import engine_loop, zero2_against_zero1
from dspatch.spec import Proof


def engine_loop_ga3():
    """`engine.backward(loss); engine.step()` over two epochs of 7 micro-batches at accumulation 3, ZeRO-2: every
    step's gradient and update as plain torch's."""
    engine_loop(3, False, "last_only", "ZeRO-2, accumulation 3: the update took the last micro-batch of each window "
                                       "only")


def trainer_ga4():
    """The Trainer at accumulation 4: ZeRO-2 logs ZeRO-1's grad_norm and ends with its weights."""
    zero2_against_zero1("ZeRO-2 in the Trainer, accumulation 4", offload=False)


PROOF = Proof(
    scenarios={"engine_loop_ga3": engine_loop_ga3, "trainer_ga4": trainer_ga4},
    expected_on_stock={"engine_loop_ga3": "the update took the last micro-batch of each window only",
                       "trainer_ga4": "ZeRO-2 in the Trainer, accumulation 4: grad_norm"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.17.5", "0.18.4"),
    silent="micro-batches dropped from the gradient, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0182",),
)
