"""Reproducers: `dspatch canary`'s comparison of a 2-rank job (dspatch.canary.in_ranks): a 2-stage `PipelineModule` of
the canary's token model at ZeRO-1, accumulation 3, SGD, `engine.train_batch()` over two epochs, each step's gradient
and update checked against plain torch's (dspatch.canary.reference). A silent bug, proven by numbers: where the
gradient is off, the reproducer says "bug" only if the last stage's is plain torch's and the first stage's is plain
torch's divided by the accumulation again (the canary's shape "stage_divided"), and fails with an error otherwise.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import Proof

GA = 3
# ZeRO-1: a ZeRO-0 pipeline of 2 stages stops at once on 0.18.3 ("Direct calls to tensor.backward()")
CONFIG = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}


def pipeline_run(accumulation=GA):
    """(plan, the runner's record, the first divergence or None) of the 2-stage pipeline at `accumulation`."""
    from dspatch.canary import in_ranks

    plan, record, found = in_ranks(CONFIG, loop="pipeline", ranks=2, accumulation=accumulation)
    if record["error"]:
        raise AssertionError(f"the pipeline run failed: {record['error']}")
    if len(record["stages"] or ()) != 2:
        raise AssertionError(f"deepspeed did not run a 2-stage pipeline on 2 ranks: {record['stages']}")
    return plan, record, found


def two_stages():
    """2 ranks, one stage each, accumulation 3: both stages train as plain torch."""
    from dspatch.canary import expect_shape

    expect_shape(pipeline_run()[2], "stage_divided", f"a 2-stage pipeline, accumulation {GA}")


PROOF = Proof(
    scenarios={"two_stages": two_stages},
    expected_on_stock={"two_stages": "1/3 of the reference on the stage before it"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.18.2", "0.19.3"),
    silent="gradients of the earlier stages GA times too small, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183",),
)
