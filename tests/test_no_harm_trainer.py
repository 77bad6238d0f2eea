"""No harm, the Trainer's recipes and a custom accelerate loop (tests/no_harm.py)."""
import pytest

from no_harm import STAGES, TRAINER, check

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("recipe", TRAINER)
def test_recipe(recipe, stage):
    check(recipe, stage)
