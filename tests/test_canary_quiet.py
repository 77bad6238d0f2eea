"""The quiet matrix of `dspatch canary`, raw engine and accelerate loops (tests/canary_matrix.py)."""
import pytest

from canary_matrix import quiet

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("loop", ["engine", "accelerate"])
def test_nothing_wrong_is_quiet(loop):
    assert quiet(loop)
