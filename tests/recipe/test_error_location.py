"""A recipe error's ``file:line`` is a file the user has: a bundled recipe is cited by its own path
(in a wheel, inside site-packages), never by the repository-relative ``recipes/...`` a pip user lacks."""
import re
from pathlib import Path

import pytest

from dal.recipe import RecipeError, check_against_hardware


def test_a_refused_bundled_recipe_cites_a_line_of_a_file_that_exists():
    with pytest.raises(RecipeError) as err:
        check_against_hardware("w4a8_fp8_performance", "a1000")
    places = re.findall(r"(\S+\.yaml):(\d+)", str(err.value))
    assert places, str(err.value)
    for file, line in places:
        path = Path(file)
        assert path.is_absolute() and path.is_file(), file
        assert path.name == "w4a8_fp8_performance.yaml"
        assert 1 <= int(line) <= len(path.read_text().splitlines())
