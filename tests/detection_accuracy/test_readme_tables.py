"""README's detection and segmentation tables are the benchmark's output (bench/results/detection.md)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("marker", ["detection-table", "segmentation-table"])
def test_readme_table_is_in_the_benchmark_output(marker):
    readme = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- {marker} -->\n(.*?)<!-- /{marker} -->", readme, flags=re.S)
    assert found, f"README.md has no <!-- {marker} --> block"
    table = found.group(1).strip()
    assert table.startswith("| model |")
    assert table in (ROOT / "bench" / "results" / "detection.md").read_text(), \
        f"README's {marker} differs from bench/results/detection.md: re-run bench/detection_accuracy.py"
