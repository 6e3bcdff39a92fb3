"""README's latency table is the benchmark's output (bench/search.py -> bench/results/search.md)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table(text: str) -> str:
    start = text.index("| model | recipe | a1000 |")
    end = text.index("\n\n", start)
    return text[start:end].strip()


def test_readme_latency_table_is_the_benchmark_output():
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "bench" / "results" / "search.md").read_text()
    assert _table(readme) == _table(bench), "README's latency table differs from bench/results/search.md: re-run it"
