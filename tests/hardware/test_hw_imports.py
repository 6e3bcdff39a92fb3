"""dal.config, dal.hardware and dal.recipe deal in strings: no torch, and only the layers above them
(for dal.hardware: dal.ops, the op registry, whose ops its op-class vocabulary names, imported
when first read).

dal.config is the neutral plumbing both loaders use; it imports nothing from them (only
dal.formats' format table), so recipe and hardware never import each other's internals for it.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dal"
ALLOWED = {"config": ("dal.config", "dal.formats.qformat"),
           "hardware": ("dal.config", "dal.formats", "dal.hardware", "dal.ops"),
           "recipe": ("dal.config", "dal.formats", "dal.hardware", "dal.recipe")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports(package):
    for path in sorted((ROOT / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("torch"), f"{path.name} imports {name}"
                if name.startswith("dal"):
                    assert name.startswith(ALLOWED[package]), f"{path.name} imports {name}"


@pytest.mark.parametrize("module", ["yaml_lines", "bundled", "errors"])
def test_recipe_does_not_reach_into_hardware_for_plumbing(module):
    """The plumbing moved to dal.config; recipe code imports it from there."""
    for path in sorted((ROOT / "recipe").glob("*.py")):
        assert f"dal.hardware.{module}" not in path.read_text(), f"{path.name} imports dal.hardware.{module}"
