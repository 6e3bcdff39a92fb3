"""Python control flow on tensor values is refused at export, naming the source line
(dal/export/data_flow.py); flow on shapes, or on parameters alone, still exports, silently.

Before, the TorchScript exporter's TracerWarning was filtered: the while loop was unrolled for
the example's iteration count, verify passed on the example and failed on zeros.
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import dal
from dal.export.errors import ExportError


class WhileLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x = self.fc(x)
        while x.abs().max() > 1:
            x = x / 2
        return x


class CountedLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        for _ in range(int(x.sum().abs())):
            y = y + 1
        return y


class ShapeFlow(nn.Module):
    """Flow on shapes (torch traces them and warns) and on a parameter (a constant of the export)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        b, n, c = x.shape
        if n != 3:
            raise ValueError("three tokens")
        y = self.fc(x).reshape(b * n, c)
        if self.fc.weight.abs().sum() > 0:
            y = y * 2
        for i in range(x.shape[0]):
            y = y + i
        return y[: int(x.size(0)) * n]


def _line(cls, text):
    src, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, s in enumerate(src) if text in s)


def _prepared(model, x):
    torch.manual_seed(0)
    q = dal.prepare_qat(model.eval(), "int8_balanced", "a2000", example_inputs=(x,))
    dal.calibrate(q, [x, x * 0.5], progress=False)
    return q


@pytest.mark.parametrize("cls,text,how", [(WhileLoop, "while x.abs().max() > 1", "bool()"),
                                          (CountedLoop, "for _ in range(int(x.sum().abs()))", "int()")])
def test_value_dependent_flow_is_refused_naming_the_line(cls, text, how):
    torch.manual_seed(0)
    x = torch.randn(2, 4) * 10
    model = _prepared(cls(), x)
    with pytest.raises(ExportError) as err:
        dal.export_onnx(model, (x,))
    msg = str(err.value)
    where = f"test_export_value_flow.py:{_line(cls, text)}: {how}"
    assert where in msg and text in msg, msg
    assert "for _ in range(K)" in msg and "torch.where" in msg  # how to make it static


def test_shape_flow_exports_without_warnings(tmp_path, monkeypatch):
    from dal.export import trace
    x = torch.randn(2, 3, 4)
    model = _prepared(ShapeFlow(), x)
    checked = []
    real = trace.check_static
    monkeypatch.setattr(trace, "check_static", lambda *a: checked.append(1) or real(*a))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        proto = dal.export_onnx(model, (x,), str(tmp_path / "m.onnx"))
    assert not [str(w.message) for w in seen]
    assert checked == [1]  # torch warned (flow on shapes), the value check ran and found none
    assert any(n.op_type == "QuantizeLinear" for n in proto.graph.node)
    import oracles
    got = oracles.run_ort(proto, {proto.graph.input[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model(x)
    assert got.shape == tuple(want.shape)


def test_plain_model_exports_without_warnings(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 8, 8)
    model = _prepared(model, x)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dal.export_onnx(model, (x,), str(tmp_path / "m.onnx"))
    assert not [str(w.message) for w in seen]


class CachesInEval(nn.Module):
    """timm LeViT's pattern: in eval (not tracing) a tensor computed from a parameter is cached."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(4))
        self.cache = {}

    def forward(self, x):
        if x.shape[1] != 3:  # flow on a shape: torch warns while tracing, the value check runs
            raise ValueError("three tokens")
        if torch.jit.is_tracing() or self.training:
            b = self.bias * 2
        else:
            b = self.cache.setdefault("b", self.bias * 2)
        return self.fc(x) + b


def test_the_value_check_leaves_no_graph_in_the_model():
    """The check's forward runs without grad: a cached tensor stays a leaf, the model deep-copies
    (dal.convert copies it)."""
    import copy
    x = torch.randn(2, 3, 4)
    model = _prepared(CachesInEval(), x)
    owner = next(m for m in model.modules() if hasattr(m, "cache"))
    owner.cache.clear()  # prepare's and calibrate's forwards filled it
    dal.export_onnx(model, (x,))
    assert owner.cache  # the value check's forward filled it again
    assert all(t.grad_fn is None for t in owner.cache.values())
    copy.deepcopy(model)
