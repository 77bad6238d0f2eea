"""Reproducers: `dspatch canary`'s comparison of a 2-rank job (dspatch.canary.in_ranks): a 2-stage `PipelineModule` of
the canary's token model at ZeRO-0 in fp32, SGD, `gradient_clipping` 0.5, 6 steps of `train_batch`, each step's
gradient and update checked against plain torch's (dspatch.canary.reference). A silent bug, proven by numbers: where
the update is off, the reproducer says "bug" only if the first step is SGD's with the gradient clipped by the first
stage's norm, and fails with an error otherwise.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

LR, CLIP = 0.05, 0.5


def _norm(gradient, names):
    return float(sum((gradient[n].double() ** 2).sum() for n in names)) ** 0.5


def clipped_by_the_first_stage(plan, record):
    """(the norm DeepSpeed clipped the first step by, the model's, the first stage's) where its first update is
    SGD's clipped by the first stage's norm; None where it is not."""
    import torch

    from dspatch.canary.reference import replay, start

    gradient = replay(plan, record)["steps"][0]["gradient"]
    names, first = sorted(gradient), record["stages"][0]
    model, first_stage = _norm(gradient, names), _norm(gradient, first)
    before, after = start(plan), record["steps"][0]["weights"]
    if all(torch.allclose(before[n] - after[n], LR * gradient[n] * CLIP / first_stage, rtol=1e-4, atol=1e-7)
           for n in names):
        return model, first_stage
    return None


def clipped_two_stages():
    """2 stages on 2 ranks, ZeRO-0, fp32, SGD, clipping at 0.5: every step is plain torch's, clipped by the model's
    gradient norm."""
    from dspatch.canary import in_ranks

    config = {"zero_optimization": {"stage": 0}, "gradient_clipping": CLIP,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    plan, record, found = in_ranks(config, loop="pipeline", ranks=2)
    if record["error"]:
        raise AssertionError(f"the pipeline run failed: {record['error']}")
    if found is None:
        return
    seen = clipped_by_the_first_stage(plan, record) if found["step"] == 1 and found["code"] == "stage_clipping" else None
    if seen:
        raise BugSeen(f"a 2-stage pipeline at ZeRO-0 clipped by the first stage's gradient norm: {seen[1]:.4g} where "
                      f"the model's is {seen[0]:.4g}")
    raise AssertionError(f"step {found['step']} ({found['what']}): {found['words']}, not as this bug clips")


PROOF = Proof(
    scenarios={"clipped_two_stages": clipped_two_stages},
    expected_on_stock={"clipped_two_stages": "clipped by the first stage's gradient norm"},
    silent="a pipeline's updates clipped too little, no message: proven by numbers",
    releases_checked=("0.14.4", "0.19.8"),
)
