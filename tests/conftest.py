"""Test-wide set-up: helpers at the top of tests/ (e.g. mnist_helpers) are importable from every folder."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
