"""``load_recipe``: a recipe from a bundled name, a YAML path, a dict or a ``Recipe``."""
from __future__ import annotations

from pathlib import Path

from dal.hardware.bundled import bundled_names, find_bundled, looks_like_path
from dal.hardware.errors import Problem
from dal.hardware.fields import did_you_mean
from dal.hardware.yaml_lines import from_data, load_yaml_file
from dal.recipe.errors import RecipeError
from dal.recipe.recipe import Recipe

FOLDER = "recipes"


def list_recipes() -> list[str]:
    """Names of the bundled recipes (``fp16_precision``, ``int8_balanced``, ...)."""
    return bundled_names(FOLDER)


def load_recipe(recipe) -> Recipe:
    """Return a validated ``Recipe``.

    ``recipe`` is a ``Recipe`` (returned as is), a bundled name (``"int8_balanced"``), a path to
    a YAML file (``str`` or ``Path``), or a dict in the YAML schema (``recipes/README.md``).

    >>> load_recipe("int8_sparse24").rules[0].sparsity      # doctest: +SKIP
    '2:4'

    Raises ``RecipeError`` naming the file, line, key, bad value and what is allowed; unknown
    keys are all listed, each with the closest valid key.
    """
    from dal.recipe.parse import parse_recipe

    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return parse_recipe(from_data(recipe, "<dict>"))
    if isinstance(recipe, (str, Path)):
        path, label = _resolve(recipe)
        return parse_recipe(load_yaml_file(path, RecipeError, label))
    raise RecipeError(Problem(
        f"recipe={recipe!r} ({type(recipe).__name__}) is not a recipe; pass a bundled name "
        f"({', '.join(list_recipes())}), a YAML path, a dict or a Recipe"))


def _resolve(spec) -> tuple[Path, str]:
    """(path, label for messages): bundled files are labelled ``recipes/<name>.yaml``."""
    if isinstance(spec, Path) or looks_like_path(spec) or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise RecipeError(Problem(f"recipe file {str(path)!r} does not exist", source=str(path)))
        return path, str(path)
    found = find_bundled(FOLDER, spec)
    if found is None:
        names = list_recipes()
        raise RecipeError(Problem(
            f"recipe={spec!r} is not a bundled recipe{did_you_mean(spec.lower(), names)} "
            f"(bundled: {', '.join(names) or '(none found)'}); or pass a path to a YAML file"))
    return found, f"{FOLDER}/{found.name}"
