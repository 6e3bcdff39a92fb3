"""Where every benchmark leaves its figures: ``bench/results/<name>``.

Benchmarks run as ``python bench/<name>.py``, so this file is importable as ``results_file``."""
from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_result(name: str, text: str) -> str:
    """Write ``text`` to ``bench/results/<name>`` (the folder made if missing); return ``text``."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name), "w") as fh:
        fh.write(text)
    return text
