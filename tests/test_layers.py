"""The architecture's one-way imports (DESIGN.md): a module may import only layers above it."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import dal

ROOT = Path(dal.__file__).parent

# Lower number = lower layer. A module may import from layers with a number <= its own. Every file
# of dal/ has one (test_every_file_has_a_layer): a package's or a top-level module's name, and
# "dal" for dal/__init__.py, the package's facade above everything (its names load lazily).
LAYERS = {
    "formats": 0, "config": 0, "nest": 0, "kernels": 0.5, "observers": 1, "quantizer": 2, "quantizer_ops": 2,
    "ops": 2.5, "hardware": 3, "recipe": 3, "nn": 4, "capture": 4.5, "sparsity": 5,
    "replace": 6, "prepare": 7, "calibration": 8, "checkpoint": 8, "preprocess": 8, "export": 9, "convert": 9.5,
    "verification": 10, "analysis": 10, "cost": 10, "ptq": 10,
    "distill": 10, "lightning": 11, "integrations": 11, "cli": 11, "__main__": 11, "dal": 12,
}
ISOLATED = {"npu"}  # the independent reference: imports nothing else from dal


def _files() -> list[Path]:
    """Every .py file under dal/: dal/__init__.py, nested packages, dal/npu and dal/ops included."""
    return sorted(ROOT.rglob("*.py"))


def _layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return "dal" if rel == ("__init__.py",) else rel[0].removesuffix(".py")


def test_every_file_has_a_layer():
    """No file escapes test_no_upward_imports: each one's layer is in LAYERS, or it is the isolated npu."""
    files = _files()
    assert ROOT / "__init__.py" in files and any(p.parent != ROOT for p in files)
    unknown = [str(p.relative_to(ROOT.parent)) for p in files if _layer_of(p) not in LAYERS.keys() | ISOLATED]
    assert not unknown, f"files with no layer in LAYERS (add theirs): {unknown}"


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
    for path in _files():
        own = _layer_of(path)
        for target, line in _dal_imports(path):
            if target == own:
                continue
            if own in ISOLATED:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{line} imports dal.{target} (npu must be independent)")
            elif target in ISOLATED and LAYERS.get(own, 99) < LAYERS["verification"]:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{line} imports dal.npu below the verify layer")
            elif target in LAYERS and LAYERS[target] > LAYERS[own]:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{line}: {own} imports {target}, a layer below it")
    assert not offenders, "\n".join(offenders)


def test_dal_never_imports_its_examples():
    """dal_examples (examples/, not in the wheel) uses dal; no module of dal/ imports it, in any
    form (import, from-import, a string that is exactly its module name, as importlib would take)."""
    offenders = []
    for path in _files():
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
