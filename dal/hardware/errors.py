"""``HardwareModelError``: a hardware model (YAML file, dict or object) is invalid.

``Problem`` and ``ConfigError`` live in ``dal.config.problems`` (shared with ``dal.recipe``)
and are re-exported here for code that imported them from ``dal.hardware.errors``.
"""
from __future__ import annotations

from dal.config.problems import ConfigError, Problem, format_path

__all__ = ["ConfigError", "HardwareModelError", "Problem", "format_path"]


class HardwareModelError(ConfigError):
    """A hardware model (YAML file, dict or object) is invalid."""

    what = "hardware model"
