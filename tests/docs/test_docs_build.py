"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs): every
page in the nav exists, every internal link resolves, every ``::: dal...`` API page finds its
object and its docstring parses, without a single warning."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDED = {"mkdocs": "mkdocs", "mkdocstrings": "mkdocstrings[python]", "mkdocstrings_handlers.python":
          "mkdocstrings[python]", "material": "mkdocs-material"}


def missing() -> list[str]:
    out = []
    for module, package in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is absent
            found = False
        if not found:
            out.append(package)
    return sorted(set(out))


@pytest.mark.slow
def test_docs_build_strictly_without_warnings(tmp_path):
    if missing():
        pytest.skip(f"the docs tools are not installed ({', '.join(missing())}): pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=ROOT, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    site = tmp_path / "site"
    page = (site / "api" / "prepare" / "index.html").read_text()
    assert "example_inputs" in page  # rendered from prepare_qat's docstring, not only its name
    assert (site / "parity" / "index.html").is_file() and (site / "workflows" / "qat" / "index.html").is_file()


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert pages and all(f": {p}" in nav for p in pages), [p for p in pages if f": {p}" not in nav]
