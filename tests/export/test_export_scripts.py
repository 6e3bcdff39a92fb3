"""The runnable scripts in export/ and bench/ work as documented (run as a user would)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["--recipe", "int8_balanced"],
                                  ["--recipe", "w4a8_fp8_performance", "--hardware", "a2000"],
                                  ["--recipe", "int8_sparse24", "--hardware", "a2000"],
                                  ["--recipe", "fp16_precision", "--hardware", "a2000"]])
def test_export_and_check_script(args, tmp_path):
    out = tmp_path / "m.onnx"
    res = subprocess.run([sys.executable, str(ROOT / "export" / "export_and_check.py"), *args, "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "vs torch" in res.stdout and out.exists()


@pytest.mark.slow
def test_bench_export_runs():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "export.py"), "--repeats", "1", "--size", "64"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ratio dal / torch" in res.stdout  # never asserted on time
