"""Every command in the README runs as written: the Python blocks, then the `dal` shell lines."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_blocks_and_dal_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write files: keep them out of the repository
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), {})
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                for line in block.splitlines() if line.strip().startswith("dal ")]
    assert commands, "README shows no dal command"
    for cmd in commands:
        argv = shlex.split(cmd)[1:]
        out = subprocess.run([sys.executable, "-m", "dal.cli", *argv], capture_output=True, text=True)
        assert out.returncode == 0, f"`{cmd}` failed:\n{out.stderr[-2000:]}"


def test_readme_starts_with_what_dal_is_and_a_pip_users_first_commands():
    text = README.read_text()
    intro = text.split("\n## ", 1)[0]
    assert "PyTorch plugin" in intro  # what dal is, before any section
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert "pip install" in first_block and "python -m dal.demo" in first_block
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert any("make demo" in b and "make test" in b for b in blocks)  # the checkout's two commands


def test_readme_accuracy_table_is_the_benchmark_output():
    text = README.read_text()
    table = re.search(r"<!-- accuracy-table -->\n(.*?)<!-- /accuracy-table -->", text, flags=re.S).group(1)
    printed = (README.parent / "bench" / "results" / "accuracy.md").read_text()
    assert table.strip() == printed.strip(), "README's table differs from bench/results/accuracy.md: re-run the bench"
