"""dal.hardware and dal.recipe deal in strings: no torch, and only the layers above them."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dal"
ALLOWED = {"hardware": ("dal.formats", "dal.hardware"),
           "recipe": ("dal.formats", "dal.hardware", "dal.recipe")}


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
