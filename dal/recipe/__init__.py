"""Recipes: the user's quantization choices inside what the hardware allows.

    >>> from dal.recipe import load_recipe, check_against_hardware
    >>> recipe = load_recipe("int8_balanced")
    >>> spec = recipe.resolve("features.0", "Conv2d", "conv")
    >>> spec.weight.format.name, spec.weight.granularity
    ('int8', 'per_channel')
    >>> report = check_against_hardware(recipe, "a1000")
"""
from dal.recipe.check import CheckReport, check_against_hardware
from dal.recipe.errors import RecipeError
from dal.recipe.load import list_recipes, load_recipe
from dal.recipe.recipe import CALIBRATION_METHODS, Calibration, Recipe
from dal.recipe.rule import Rule
from dal.recipe.spec import OBSERVERS, LayerSpec, TensorSpec

__all__ = [
    "CALIBRATION_METHODS", "Calibration", "CheckReport", "LayerSpec", "OBSERVERS", "Recipe", "RecipeError",
    "Rule", "TensorSpec", "check_against_hardware", "list_recipes", "load_recipe",
]
