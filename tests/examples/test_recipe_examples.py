"""Each recipe's training example runs end to end (tiny budgets) and its export verifies."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "recipes" / "examples").glob("train_*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_recipe_example_runs(script, tmp_path):
    out = subprocess.run([sys.executable, str(script), "--train-limit", "256", "--test-limit", "128",
                          "--float-steps", "2", "--qat-steps", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "npu_vs_torch" in out.stdout
    assert list(tmp_path.glob("*.onnx")) and list(tmp_path.glob("*.pt"))
