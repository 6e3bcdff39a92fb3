"""A feature that needs an optional extra says which, at the call that needs it, and fails fast."""
import importlib
import sys

import pytest
import torch

import dal
from dal_examples.zoo import MnistCNN


def _never_read():
    """Data whose first batch raises: proves the call failed before reading any of it."""
    raise AssertionError("build_report read the data before checking for matplotlib")
    yield  # pragma: no cover


def test_build_report_without_matplotlib_fails_fast_naming_the_extra(tmp_path, monkeypatch):
    from dal.analysis.report import build_report

    x = torch.randn(2, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'dal\[report\]'"):
        build_report(model, _never_read(), out=tmp_path / "r.html", progress=False)
    assert not (tmp_path / "r.html").exists()


def test_the_lightning_callback_without_lightning_names_the_extra(monkeypatch):
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m == "dal.lightning" or m.startswith("dal.lightning.")]:
        monkeypatch.delitem(sys.modules, name)  # restored afterwards by monkeypatch
    with pytest.raises(ImportError, match=r"pip install 'dal\[lightning\]'"):
        importlib.import_module("dal.lightning")
