"""No harm, trl's trainers (tests/no_harm.py)."""
import pytest

from no_harm import STAGES, TRL, check

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("recipe", TRL)
def test_recipe(recipe, stage):
    check(recipe, stage)
