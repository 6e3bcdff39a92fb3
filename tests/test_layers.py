"""The architecture's one-way imports (DESIGN.md): a module may import only layers above it."""
import ast
import subprocess
import sys
from pathlib import Path

import dal

ROOT = Path(dal.__file__).parent

# Lower number = lower layer. A module may import from layers with a number <= its own.
LAYERS = {
    "formats": 0, "config": 0, "nest": 0, "kernels": 0.5, "observers": 1, "quantizer": 2, "hardware": 3, "recipe": 3, "nn": 4, "sparsity": 5,
    "replace": 6, "prepare": 7, "calibration": 8, "checkpoint": 8, "preprocess": 8, "export": 9, "convert": 9.5,
    "verification": 10, "analysis": 10, "cost": 10, "ptq": 10,
    "distill": 10, "lightning": 11, "integrations": 11, "cli": 11, "datasets": 12, "zoo": 12, "zoo_detection": 12, "training": 12, "demo": 12,
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


def test_import_dal_is_light():
    code = ("import sys, dal; heavy = [m for m in ('torch', 'pytorch_lightning', 'lightning', 'onnxruntime', "
            "'torch.utils.cpp_extension') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"import dal pulled in {out}"
