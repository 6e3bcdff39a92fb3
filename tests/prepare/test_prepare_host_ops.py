"""Ops the NPU cannot run surface at prepare, not at verify: torch.nonzero, compares of integer
tensors (exported LessOrEqual / GreaterOrEqual on int64), gathers by a tensor of indices
(GatherElements), running sums (CumSum), top-k (TopK) and 3-D convolution. Each is a row of prepare's report
with status "host" and its source line; ``strict=True`` raises naming them; a hardware model
that lists the op class under ``ops:`` runs it instead (dal.hardware.op_classes.HOST_OP_CLASSES).

Before, all of them passed prepare (also with strict=True) and export, and dal.verify failed with
"UnsupportedNode ... NonZero" (the oracle here: dal.npu, which has no kernel for these nodes, and
the exported file, which holds them).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.hardware import load_hardware


class NonZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.c(x)
        return y, torch.nonzero(y > 0)


class IntCompare(nn.Module):
    """A causal mask from positions (Hugging Face's mask arithmetic): LessOrEqual on int64."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        i = torch.arange(x.shape[-1])
        mask = (i[None, :] <= i[:, None]).to(x.dtype)
        return self.fc(x) @ mask


class GreaterEqual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        keep = torch.ge(torch.arange(x.shape[-1]), 3).to(x.dtype)
        return self.fc(x) * keep


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.gather(y, 1, (x > 0).long())


class CumSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumsum(self.fc(x), dim=-1)


class TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).topk(3, dim=-1).values


class Conv3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv3d(2, 4, 3)

    def forward(self, x):
        return self.c(x)


class UntracedCumSum(nn.Module):
    """fx cannot trace this forward (a branch on an argument's type): the call-site capture finds
    the cumsum, with the dtype of real tensors."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if isinstance(x, (list, tuple)):
            x = x[0]
        y = self.fc(x)
        return y.cumsum(-1) + (torch.arange(x.shape[-1]) >= 2).to(y.dtype)


def _line(cls, text):
    src, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, s in enumerate(src) if text in s)


#: (module, input shape, op class, function, source text of the call, or None for a module)
CASES = [
    (NonZero, (1, 3, 6, 6), "nonzero", "nonzero", "torch.nonzero(y > 0)"),
    (IntCompare, (2, 8), "compare", "le", "i[None, :] <= i[:, None]"),
    (GreaterEqual, (2, 8), "compare", "ge", "torch.ge(torch.arange"),
    (Gather, (2, 8), "gather", "gather", "torch.gather(y, 1"),
    (CumSum, (2, 8), "scan", "cumsum", "torch.cumsum(self.fc(x)"),
    (TopK, (2, 8), "sort", "topk", "self.fc(x).topk(3"),
    (Conv3d, (1, 2, 5, 5, 5), "conv3d", "Conv3d", None),
]


def _host_rows(model):
    return [r for r in dal.prepared(model).report.rows if r.status == "host"]


@pytest.mark.parametrize("cls,shape,op_class,function,text", CASES, ids=[c[0].__name__ for c in CASES])
def test_listed_as_host_with_its_line(cls, shape, op_class, function, text):
    torch.manual_seed(0)
    x = torch.randn(shape)
    q = dal.prepare_qat(cls().eval(), "int8_balanced", "a2000", example_inputs=(x,))
    rows = _host_rows(q)
    assert [(r.op_class, r.type_name) for r in rows] == [(op_class, function)], str(dal.prepared(q).report)
    report = str(dal.prepared(q).report)
    assert "1 on the host" in report.splitlines()[0] and "runs on the host CPU" in rows[0].detail
    if text is not None:
        assert f"called at test_prepare_host_ops.py:{_line(cls, text)}" in rows[0].detail, rows[0].detail
    else:
        assert rows[0].name == "c"
    with torch.no_grad():  # prepare changed nothing about the op itself
        q(x)


@pytest.mark.parametrize("cls,shape,op_class,function,text", CASES, ids=[c[0].__name__ for c in CASES])
def test_strict_refuses_naming_them(cls, shape, op_class, function, text):
    x = torch.randn(shape)
    with pytest.raises(ValueError, match="cannot run") as err:
        dal.prepare_qat(cls().eval(), "int8_balanced", "a2000", example_inputs=(x,), strict=True)
    msg = str(err.value)
    assert f"({op_class})" in msg, msg
    if text is not None:
        assert f"test_prepare_host_ops.py:{_line(cls, text)}" in msg, msg


def test_the_exported_file_holds_what_the_report_names(tmp_path):
    """The report is right about the file: the NonZero node is there, and dal.npu cannot run it."""
    import dal.npu
    x = torch.randn(1, 3, 6, 6)
    q = dal.prepare_qat(NonZero().eval(), "int8_balanced", "a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    proto = dal.export_onnx(q, (x,))
    assert "NonZero" in {n.op_type for n in proto.graph.node}
    with pytest.raises(dal.npu.UnsupportedNode, match="NonZero"):
        dal.npu.run(proto, {proto.graph.input[0].name: x.numpy()})


def test_untraced_forward_found_by_call_site():
    x = torch.randn(2, 8)
    q = dal.prepare_qat(UntracedCumSum().eval(), "int8_balanced", "a2000", example_inputs=(x,))
    rows = {r.type_name: r for r in _host_rows(q)}
    assert set(rows) == {"cumsum", "ge"}, str(dal.prepared(q).report)
    line = _line(UntracedCumSum, "y.cumsum(-1)")
    assert all(f"test_prepare_host_ops.py:{line}" in r.detail for r in rows.values())


def test_float_and_constant_compares_stay_off_the_list():
    """A compare of float activations (exported Greater, which dal.npu runs) and one of constants
    (folded by the exporter) are not host ops."""

    class FloatCompare(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            return y * (y > 0).to(y.dtype) * (torch.arange(8) >= 3).to(y.dtype)

    x = torch.randn(2, 8)
    q = dal.prepare_qat(FloatCompare().eval(), "int8_balanced", "a2000", example_inputs=(x,), strict=True)
    assert not _host_rows(q)


def test_hardware_listing_the_op_class_runs_it():
    hw = load_hardware("a2000").to_dict()
    hw["name"] = "a2000_scan"
    hw["ops"]["scan"] = {"engine": "vector", "input_formats": ["int8", "fp16"], "output_formats": ["int8", "fp16"]}
    x = torch.randn(2, 8)
    q = dal.prepare_qat(CumSum().eval(), "int8_balanced", hw, example_inputs=(x,), strict=True)
    assert not _host_rows(q)
    assert [r.status for r in dal.prepared(q).report.rows if r.type_name == "cumsum"] == ["float"]


def test_functional_conv3d():
    class F3(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 2, 3, 3, 3))

        def forward(self, x):
            return F.conv3d(x, self.w)

    q = dal.prepare_qat(F3().eval(), "int8_balanced", "a2000", example_inputs=(torch.randn(1, 2, 5, 5, 5),))
    assert [r.op_class for r in _host_rows(q)] == ["conv3d"]
