"""The README's shape and its tables. That every block runs as written, from another folder on the
installed wheel, is tests/packaging/test_wheel.py's test."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_what_dal_is_and_a_pip_users_first_commands():
    text = README.read_text()
    intro = text.split("\n## ", 1)[0]
    assert "PyTorch plugin" in intro  # what dal is, before any section
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert "pip install" in first_block and "python -m dal_examples.demo" in first_block
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert any("make demo" in b and "make test" in b for b in blocks)  # the checkout's two commands


def test_readme_accuracy_table_is_the_benchmark_output():
    text = README.read_text()
    table = re.search(r"<!-- accuracy-table -->\n(.*?)<!-- /accuracy-table -->", text, flags=re.S).group(1)
    printed = (README.parent / "bench" / "results" / "accuracy.md").read_text()
    assert table.strip() == printed.strip(), "README's table differs from bench/results/accuracy.md: re-run the bench"
