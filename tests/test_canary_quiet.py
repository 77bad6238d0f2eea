"""The quiet matrix of `dspatch canary`, raw engine and accelerate loops (tests/canary_matrix.py)."""
import pytest

from canary_matrix import finding_pipeline_clipping, judged_runs, pipeline_configurations, quiet, quiet_two_ranks

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("loop", ["engine", "accelerate"])
def test_nothing_wrong_is_quiet(loop):
    assert quiet(loop)


@pytest.mark.parametrize("loop", ["trainer", "accelerate"])
def test_two_ranks_shard_the_data_as_the_reference_does(loop):
    """Two ranks under the loops that shard their own data: each rank trains on its own micro-batches, averaged."""
    assert quiet_two_ranks(loop)


@pytest.fixture(scope="module")
def pipelines():
    """One 2-rank job for the pipeline loop's matrix and the finding (dspatch canary --loop pipeline)."""
    return judged_runs([*pipeline_configurations(), finding_pipeline_clipping()])


def test_pipelines_with_nothing_wrong_are_quiet(pipelines):
    finding, _ = finding_pipeline_clipping()
    loud = {label: found for label, (found, _, _) in pipelines.items() if label != finding and found}
    assert len(pipelines) > 1 and not loud, loud


def test_a_pipeline_at_zero0_in_fp32_clips_by_its_first_stages_norm(pipelines):
    """A bug no patch fixes (none known upstream when the canary found it; every release 0.14.4-0.19.8): the canary
    reports it, names no known bug, and the numbers are DeepSpeed's clipping with the first stage's norm: SGD's first
    step moved by lr * gradient * 0.5 / |gradient of stage 0| where the config means 0.5 / |gradient|."""
    import torch

    from dspatch.canary.reference import start

    label, plan = finding_pipeline_clipping()
    found, record, want = pipelines[label]
    assert found and found["step"] == 1 and found["code"] == "clipping" and found["known"] == [], found
    gradient, names = want["steps"][0]["gradient"], sorted(want["steps"][0]["gradient"])
    first_stage = record["stages"][0]
    assert set(first_stage) < set(names), record["stages"]
    norm_of = lambda which: float(torch.sqrt(sum((gradient[n].double() ** 2).sum() for n in which)))  # noqa: E731
    assert norm_of(names) > 0.5  # the config clips this step
    before = start(plan)
    for n in names:
        moved = before[n] - record["steps"][0]["weights"][n]
        assert torch.allclose(moved, 0.05 * gradient[n] * 0.5 / norm_of(first_stage), rtol=1e-4, atol=1e-7), n
