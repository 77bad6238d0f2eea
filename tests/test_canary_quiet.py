"""The quiet matrix of `dspatch canary`, raw engine, accelerate and pipeline loops (tests/canary_matrix.py)."""
import pytest

from canary_matrix import quiet, quiet_pipeline, quiet_two_ranks

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("loop", ["engine", "accelerate"])
def test_nothing_wrong_is_quiet(loop):
    assert quiet(loop)


@pytest.mark.parametrize("loop", ["trainer", "accelerate"])
def test_two_ranks_shard_the_data_as_the_reference_does(loop):
    """Two ranks under the loops that shard their own data: each rank trains on its own micro-batches, averaged."""
    assert quiet_two_ranks(loop)


def test_pipelines_with_nothing_wrong_are_quiet():
    """A 2-stage pipeline on 2 ranks (one job for the whole matrix): trains, with DSPATCH=1, as plain torch."""
    assert quiet_pipeline()
