"""README's LLM accuracy table is the benchmark's output (bench/results/llm_accuracy.md, written by
bench/llm_accuracy.py --write), and its gap-recovered column follows from its perplexity column."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["float", "RTN W4A8", "GPTQ W4A8", "SparseGPT 2:4 + W4A8", "QAT W4A8 from RTN", "QAT W4A8 from GPTQ",
        "QAT 2:4 + W4A8 from SparseGPT", "QAT W4A8 + FP8 KV cache", "float + the QAT steps (baseline)"]


def _readme_block() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- llm-accuracy-table -->\n(.*?)<!-- /llm-accuracy-table -->", readme, flags=re.S)
    assert found, "README.md has no <!-- llm-accuracy-table --> block"
    return found.group(1).strip()


def test_readme_llm_table_is_the_benchmark_output():
    printed = (ROOT / "bench" / "results" / "llm_accuracy.md").read_text().strip()
    assert _readme_block() == printed, \
        "README's LLM table differs from bench/results/llm_accuracy.md: re-run bench/llm_accuracy.py --write"


def test_llm_table_has_every_row_and_consistent_gaps():
    rows = {}
    for line in _readme_block().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ROWS:
            rows[cells[0]] = cells
    assert list(rows) == ROWS, "the table's rows are the issue's rows, in its order"
    ppl_float, ppl_rtn = float(rows["float"][1]), float(rows["RTN W4A8"][1])
    stated = re.search(r"RTN loses (-?[0-9.]+)% perplexity against float", _readme_block())
    assert stated, "the table states RTN's loss against float"
    assert abs(float(stated.group(1)) - 100 * (ppl_rtn / ppl_float - 1)) <= 0.005 + 100 * 1e-4 / ppl_float
    for name, cells in rows.items():
        if cells[1] == "not available" or cells[5] == "-":
            continue
        lo, hi = (float(v) for v in cells[2].split(" - "))
        ppl = float(cells[1])
        assert lo <= ppl <= hi, name
        gap = (ppl_rtn - ppl) / (ppl_rtn - ppl_float)
        # the printed gap is rounded to a whole percent from unrounded means: allow that rounding and
        # the perplexities' 4 printed decimals (+-5e-5 each: 1e-4 on the numerator and on the denominator)
        slack = 0.005 + (1e-4 + abs(gap) * 1e-4) / (ppl_rtn - ppl_float)
        assert abs(float(cells[5].rstrip("%")) / 100 - gap) <= slack, name
