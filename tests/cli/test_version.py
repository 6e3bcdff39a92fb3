"""``dal --version`` and ``dal.__version__`` give the version pyproject.toml declares."""
import subprocess
import sys
from pathlib import Path

import pytest

import dal

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

DECLARED = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]


def test_python_m_dal_version_prints_the_declared_version():
    out = subprocess.run([sys.executable, "-m", "dal", "--version"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"dal {DECLARED}"


def test_dunder_version_is_the_package_metadata():
    assert dal.__version__ == DECLARED


def test_import_dal_does_not_read_the_metadata():
    code = "import dal, sys; print('__version__' in vars(dal), 'importlib.metadata' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False"
