"""``RecipeError``: a recipe is malformed, or asks for what the hardware cannot do."""
from __future__ import annotations

from dal.config.problems import ConfigError


class RecipeError(ConfigError):
    """A recipe is invalid (``problems`` lists every problem, each with file:line and key)."""

    what = "recipe"
