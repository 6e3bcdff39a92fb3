"""The architecture's one-way imports (DESIGN.md): a module may import only layers above it."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import dal

ROOT = Path(dal.__file__).parent

# Lower number = lower layer. A module may import from layers with a number <= its own.
LAYERS = {
    "formats": 0, "config": 0, "nest": 0, "kernels": 0.5, "observers": 1, "quantizer": 2, "ops": 2.5, "hardware": 3, "recipe": 3, "nn": 4, "sparsity": 5,
    "replace": 6, "prepare": 7, "calibration": 8, "checkpoint": 8, "preprocess": 8, "export": 9, "convert": 9.5,
    "verification": 10, "analysis": 10, "cost": 10, "ptq": 10,
    "distill": 10, "lightning": 11, "integrations": 11, "cli": 11,
}
ISOLATED = {"npu"}  # the independent reference: imports nothing else from dal


def _layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py")


def _dal_imports(path: Path):
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(ROOT.parent).with_suffix("").parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dal."):
                    yield a.name.split(".")[1], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level]
                mod = ".".join(base + tuple(filter(None, (node.module or "").split("."))))
            else:
                mod = node.module or ""
            parts = mod.split(".")
            if parts[0] == "dal" and len(parts) > 1:
                yield parts[1], node.lineno
            elif parts == ["dal"]:
                for a in node.names:
                    yield a.name, node.lineno


def test_no_upward_imports():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == ROOT:
            continue
        own = _layer_of(path)
        for target, line in _dal_imports(path):
            if target == own:
                continue
            if own in ISOLATED:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{line} imports dal.{target} (npu must be independent)")
            elif target in ISOLATED and LAYERS.get(own, 99) < LAYERS["verification"]:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{line} imports dal.npu below the verify layer")
            elif target in LAYERS and own in LAYERS and LAYERS[target] > LAYERS[own]:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{line}: {own} imports {target}, a layer below it")
    assert not offenders, "\n".join(offenders)


def test_dal_never_imports_its_examples():
    """dal_examples (examples/, not in the wheel) uses dal; no module of dal/ imports it, in any
    form (import, from-import, a string that is exactly its module name, as importlib would take)."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # importlib.import_module("...")
                names = [node.value] if re.fullmatch(r"dal_examples(\.\w+)*", node.value) else []
            offenders += [f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] == "dal_examples"]
    assert not offenders, "\n".join(offenders)
    assert not (ROOT / "zoo.py").exists() and not (ROOT / "datasets").exists()  # the examples live in examples/


def test_import_dal_is_light():
    code = ("import sys, dal; heavy = [m for m in ('torch', 'pytorch_lightning', 'lightning', 'onnxruntime', "
            "'torch.utils.cpp_extension') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"import dal pulled in {out}"
