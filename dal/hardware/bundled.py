"""Where the YAML files shipped with dal live, and lookup of one by name.

The repository's top-level ``hardware_models/`` and ``recipes/`` folders sit next to the
``dal`` package (the project is installed editable); a wheel may carry copies under
``dal/_bundled/<folder>``. The first folder that has ``<name>.yaml`` wins.
"""
from __future__ import annotations

from pathlib import Path


def bundled_dirs(folder: str) -> list[Path]:
    """Existing folders that may hold bundled ``folder`` files, in lookup order."""
    package = Path(__file__).resolve().parents[1]  # .../dal
    candidates = [package.parent / folder, package / "_bundled" / folder]
    return [d for d in candidates if d.is_dir()]


def bundled_names(folder: str) -> list[str]:
    """Sorted names (file stems) of every bundled ``*.yaml`` in ``folder``."""
    return sorted({p.stem for d in bundled_dirs(folder) for p in d.glob("*.yaml")})


def find_bundled(folder: str, name: str) -> Path | None:
    """Path of the bundled ``<name>.yaml`` (case-insensitive name), or None."""
    for d in bundled_dirs(folder):
        path = d / f"{name.lower()}.yaml"
        if path.is_file():
            return path
    return None


def looks_like_path(text: str) -> bool:
    return text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text
