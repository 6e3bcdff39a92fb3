"""``load_recipe``: a recipe from a bundled name, a YAML path, a dict or a ``Recipe``."""
from __future__ import annotations

from dal.config.resolve import ConfigKind, list_bundled, load_config
from dal.config.yaml_lines import YamlDoc
from dal.recipe.errors import RecipeError
from dal.recipe.recipe import Recipe

FOLDER = "recipes"


def _parse(doc: YamlDoc) -> Recipe:
    from dal.recipe.parse import parse_recipe

    return parse_recipe(doc)


KIND = ConfigKind(noun="recipe", arg="recipe", folder=FOLDER, error=RecipeError, type=Recipe, parse=_parse)


def list_recipes() -> list[str]:
    """Names of the bundled recipes (``fp16_precision``, ``int8_balanced``, ...)."""
    return list_bundled(KIND)


def load_recipe(recipe) -> Recipe:
    """Return a validated ``Recipe``.

    ``recipe`` is a ``Recipe`` (returned as is), a bundled name (``"int8_balanced"``), a path to
    a YAML file (``str`` or ``Path``), or a dict in the YAML schema (``recipes/README.md``).

    >>> load_recipe("int8_sparse24").rules[0].sparsity      # doctest: +SKIP
    '2:4'

    Raises ``RecipeError`` naming the file, line, key, bad value and what is allowed; unknown
    keys are all listed, each with the closest valid key.
    """
    return load_config(recipe, KIND)
