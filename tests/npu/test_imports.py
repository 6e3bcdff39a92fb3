"""dal.npu is an independent implementation: it imports nothing from the rest of dal, and
importing it does no work (no torch, no cpp_extension)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

NPU = pathlib.Path(__file__).resolve().parents[2] / "dal" / "npu"


def test_no_imports_from_rest_of_dal():
    bad = []
    for f in NPU.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level >= 2:
                    bad.append(f"{f.name}: relative import level {node.level}")
                mods = [node.module or ""] if node.level == 0 else []
            for m in mods:
                if (m == "dal" or m.startswith("dal.")) and not m.startswith("dal.npu"):
                    bad.append(f"{f.name}: {m}")
    assert not bad, bad


def test_import_is_lazy():
    code = ("import sys, dal.npu; "
            "print(int('torch' in sys.modules), int('torch.utils.cpp_extension' in sys.modules), int('onnx' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(NPU.parents[1])).stdout.split()
    assert out == ["0", "0", "0"], out
