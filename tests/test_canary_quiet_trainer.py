"""The quiet matrix of `dspatch canary`, the Trainer (tests/canary_matrix.py; a file of its own: another worker)."""
import pytest

from canary_matrix import quiet

pytestmark = pytest.mark.stack


def test_nothing_wrong_is_quiet_under_the_trainer():
    assert quiet("trainer")
