"""Where the YAML files shipped with dal live, and lookup of one by name.

There is one source of truth for each bundled file: the repository's top-level
``recipes/*.yaml`` and ``hardware_models/*.yaml``. A wheel carries them as package data in
``dal/_bundled/<folder>/`` (copied there in the build directory only, by ``setup.py``'s
``build_py``), found through ``importlib.resources``. A source checkout (an editable
install, or ``dal`` imported from the repository) has no ``dal/_bundled`` and falls back to
the repository folders next to the package.

Lookup order: the package data first, then the repository folder; the first folder that has
``<name>.yaml`` wins.

    >>> "int8_balanced" in bundled_names("recipes")
    True
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

#: The folders of bundled files, as named at the repository's top level.
FOLDERS = ("hardware_models", "recipes")


def _package_root() -> Path:
    return Path(str(resources.files("dal")))


def bundled_dirs(folder: str) -> list[Path]:
    """Existing folders that may hold bundled ``folder`` files (one of ``FOLDERS``), in lookup order.

    ``dal/_bundled/<folder>`` (the wheel's package data), then ``<repository>/<folder>``, the
    latter only when the package sits in a source checkout (its parent has ``pyproject.toml``),
    so that an unrelated ``recipes/`` folder next to an installed package is never read.
    """
    if folder not in FOLDERS:
        raise ValueError(f"folder={folder!r} is not a bundled folder (one of: {', '.join(FOLDERS)})")
    package = _package_root()
    candidates = [package / "_bundled" / folder]
    if (package.parent / "pyproject.toml").is_file():
        candidates.append(package.parent / folder)
    return [d for d in candidates if d.is_dir()]


def bundled_names(folder: str) -> list[str]:
    """Sorted names (file stems) of every bundled ``*.yaml`` in ``folder``."""
    return sorted({p.stem for d in bundled_dirs(folder) for p in d.glob("*.yaml")})


def find_bundled(folder: str, name: str) -> Path | None:
    """Path of the bundled ``<name>.yaml`` in ``folder`` (case-insensitive name), or None."""
    for d in bundled_dirs(folder):
        path = d / f"{name.lower()}.yaml"
        if path.is_file():
            return path
    return None


def looks_like_path(text: str) -> bool:
    """Whether ``text`` is meant as a file path (a YAML suffix or a directory separator), not a name."""
    return text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text
