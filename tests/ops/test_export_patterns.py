"""Every export pattern dal's op registry declares (the family files' entries: a user's op states
its own) is run by dal.npu and stated in export/SPEC.md.

An Op's ``onnx`` lists the ONNX node types its export pattern emits besides Q / DQ, and its
``spec`` the export/SPEC.md section that states them. The oracles are dal.npu's own kernel table
(``dal.npu.op_table.op_types``: the node types a dal.npu Session runs; it refuses any other) and
the text of export/SPEC.md, neither written from the registry.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.npu.op_table import op_types
from dal.ops import Op

SPEC = Path(__file__).resolve().parents[2] / "export" / "SPEC.md"


def spec_sections(text: str) -> dict[str, str]:
    """``"§5b"`` -> the text of the section headed ``## 5b. ...`` (or ``### 6a. ...``), from its
    heading to the next heading of any level."""
    parts = re.split(r"(?m)^(?=#{2,4} )", text)
    out = {}
    for part in parts:
        m = re.match(r"#{2,4} (\d+[a-z]?)\.\s", part)
        if m:
            out["§" + m.group(1)] = part
    return out


def mentions(section: str, node_type: str) -> bool:
    """Does ``section`` name ONNX node type ``node_type`` as a word (``Gather`` is not found in
    ``GatherElements``)?"""
    return re.search(rf"(?<![A-Za-z]){re.escape(node_type)}(?![A-Za-z])", section) is not None


def pattern_problems(ops, npu_types, sections) -> list[str]:
    """Every way ``ops`` break the rule: a node type dal.npu does not run, an export pattern with
    no section, a section SPEC.md lacks, a section that does not name one of the op's node types."""
    bad = []
    for op in ops:
        for t in op.onnx:
            if t not in npu_types:
                bad.append(f"{op.name}: ONNX node type {t!r} has no dal.npu implementation")
        if op.onnx and not op.spec:
            bad.append(f"{op.name}: exports {op.onnx} but names no export/SPEC.md section (spec='')")
        if not op.spec:
            continue
        if op.spec not in sections:
            bad.append(f"{op.name}: spec={op.spec!r} is not a section of export/SPEC.md")
            continue
        for t in op.onnx:
            if not mentions(sections[op.spec], t):
                bad.append(f"{op.name}: export/SPEC.md {op.spec} does not mention {t}")
    return bad


def family_ops() -> list:
    """dal's own ops: every family file's ``OPS`` (dal/ops/<family>.py), whatever users or other
    tests registered."""
    import importlib

    from dal.ops.registry import FAMILIES

    return [op for family in FAMILIES for op in importlib.import_module(f"dal.ops.{family}").OPS]


@pytest.fixture(scope="module")
def npu_types():
    return op_types()


@pytest.fixture(scope="module")
def sections():
    return spec_sections(SPEC.read_text())


def test_the_oracles_are_what_they_claim(npu_types, sections):
    # dal.npu runs the node types of a QDQ Conv and refuses others (its Session says so by op type)
    assert {"Conv", "QuantizeLinear", "DequantizeLinear", "GridSample", "ScatterElements"} <= npu_types
    assert "NonMaxSuppression" not in npu_types and "Constant" not in npu_types
    assert {"§2", "§5a", "§5b", "§6", "§6a"} <= set(sections)
    assert mentions(sections["§5b"], "GridSample") and not mentions(sections["§5d"], "GatherND")


def test_every_export_node_type_runs_on_dal_npu(npu_types):
    missing = [f"{op.name}: {t}" for op in family_ops() for t in op.onnx if t not in npu_types]
    assert not missing, "node types no dal.npu kernel implements:\n" + "\n".join(missing)


def test_every_export_pattern_is_stated_in_spec(npu_types, sections):
    bad = pattern_problems(family_ops(), npu_types, sections)
    assert not bad, "\n".join(bad)


def test_fp16_region_nodes_are_stated_in_spec_6(sections):
    """export/casts.py builds FP16 regions from the ops' ``fp16_region`` (``half_ops()``,
    ``half_tail_ops()``); §6 names every node type such a region may hold."""
    from dal.export.casts import half_ops, half_tail_ops

    assert {"Conv", "Gemm", "MatMul", "Add", "Concat"} <= half_ops() and {"Relu", "Clip"} <= half_tail_ops()
    unstated = sorted(t for t in half_ops() | half_tail_ops() if not mentions(sections["§6"], t))
    assert not unstated, f"export/SPEC.md §6 does not name {unstated}"


def test_export_patterns_are_declared():
    """The registry declares the patterns the exporter writes for its core ops (a registry with
    no ``onnx`` anywhere would pass the checks above vacuously)."""
    have = {op.name: op.onnx for op in family_ops()}
    for name, node in [("add", "Add"), ("mul", "Mul"), ("cat", "Concat"), ("matmul", "MatMul"),
                       ("grid_sample", "GridSample")]:
        assert node in have[name], (name, have[name])
    assert sum(bool(op.onnx) for op in family_ops()) >= 10


@pytest.mark.parametrize("onnx,spec,expect", [
    (("NoSuchNode",), "§5a", "'NoSuchNode' has no dal.npu implementation"),
    (("Relu",), "§99", "'§99' is not a section"),
    (("GridSample",), "§5d", "§5d does not mention GridSample"),
    (("Relu",), "", "names no export/SPEC.md section"),
])
def test_a_broken_entry_is_named(npu_types, sections, onnx, spec, expect):
    # a throw-away Op, never registered: the check names it and what is wrong with it
    bogus = Op(name="bogus_pattern", op_class="custom", handling="float", onnx=onnx, spec=spec)
    bad = pattern_problems([*family_ops(), bogus], npu_types, sections)
    assert any(b.startswith("bogus_pattern:") and expect in b for b in bad), bad
    fine = Op(name="fine_pattern", op_class="custom", handling="float", onnx=("Relu",), spec="§5a")
    assert pattern_problems([fine], npu_types, sections) == []


# ---- the exporter writes what the entries declare --------------------------------------------

class _AfterConv(nn.Module):
    """A quantized 1x1 conv, then the op under test (a module or a function of the conv's output)."""

    def __init__(self, then):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.then = then

    def forward(self, x):
        return self.then(self.conv(x))


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


_X4 = (1, 3, 8, 8)
#: (op name, the model, its input shape): one tiny export per op, the op after a quantized conv
#: unless the op is the layer itself
_EXPORTS = [
    ("linear", lambda: nn.Sequential(nn.Linear(8, 4)), (2, 8)),
    ("linear", lambda: nn.Sequential(nn.Linear(8, 4)), (2, 5, 8)),
    ("conv_transpose2d", lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3)), _X4),
    ("embedding", lambda: nn.Sequential(nn.Embedding(16, 8)), None),
    ("relu", lambda: _AfterConv(nn.ReLU()), _X4),
    ("relu6", lambda: _AfterConv(nn.ReLU6()), _X4),
    ("hardtanh", lambda: _AfterConv(_Fn(lambda t: t.clamp(-1, 1))), _X4),
    ("leaky_relu", lambda: _AfterConv(nn.LeakyReLU(0.1)), _X4),
    ("prelu", lambda: _AfterConv(nn.PReLU(4)), _X4),
    ("elu", lambda: _AfterConv(nn.CELU()), _X4),
    ("selu", lambda: _AfterConv(nn.SELU()), _X4),
    ("gelu", lambda: _AfterConv(nn.GELU()), _X4),
    ("silu", lambda: _AfterConv(nn.SiLU()), _X4),
    ("sigmoid", lambda: _AfterConv(nn.Sigmoid()), _X4),
    ("tanh", lambda: _AfterConv(nn.Tanh()), _X4),
    ("hardswish", lambda: _AfterConv(nn.Hardswish()), _X4),
    ("mish", lambda: _AfterConv(nn.Mish()), _X4),
    ("max_pool", lambda: _AfterConv(nn.MaxPool2d(2)), _X4),
    ("avg_pool", lambda: _AfterConv(nn.AdaptiveAvgPool2d(1)), _X4),
    ("lp_pool", lambda: _AfterConv(nn.LPPool2d(2, 2)), _X4),
    ("mean", lambda: _AfterConv(_Fn(lambda t: t.mean(dim=(2, 3)))), _X4),
    ("softmax", lambda: _AfterConv(nn.Softmax(1)), _X4),
    ("log_softmax", lambda: _AfterConv(nn.LogSoftmax(1)), _X4),
    ("resize", lambda: _AfterConv(nn.Upsample(scale_factor=2, mode="bilinear")), _X4),
    ("groupnorm", lambda: _AfterConv(nn.GroupNorm(2, 4)), _X4),
    ("instancenorm2d", lambda: _AfterConv(nn.InstanceNorm2d(4)), _X4),
    ("batchnorm", lambda: nn.Sequential(nn.Conv1d(3, 4, 1), nn.ReLU(), nn.BatchNorm1d(4)), (1, 3, 16)),
    ("flatten", lambda: _AfterConv(nn.Flatten()), _X4),
    ("permute", lambda: _AfterConv(_Fn(lambda t: t.permute(0, 2, 3, 1))), _X4),
    ("stack", lambda: _AfterConv(_Fn(lambda t: torch.stack([t, t], 1))), _X4),
    ("pixel_shuffle", lambda: _AfterConv(nn.PixelShuffle(2)), _X4),
    ("add", lambda: _AfterConv(_Fn(lambda t: t + t * 2)), _X4),
    ("mul", lambda: _AfterConv(_Fn(lambda t: t * t)), _X4),
    ("cat", lambda: _AfterConv(_Fn(lambda t: torch.cat([t, t * 2], 1))), _X4),
    ("matmul", lambda: _AfterConv(_Fn(lambda t: t @ t)), _X4),
    ("gather", lambda: _AfterConv(_Fn(lambda t: t.index_select(1, torch.tensor([0, 2])))), _X4),
    ("scatter_add", lambda: _AfterConv(_Fn(lambda t: torch.zeros(1, 4, 8, 8).scatter_add(
        1, torch.zeros(1, 4, 8, 8, dtype=torch.long), t))), _X4),
    ("grid_sample", lambda: _AfterConv(_Fn(lambda t: F.grid_sample(
        t, torch.tanh(t[:, :2].permute(0, 2, 3, 1)), align_corners=False))), _X4),
]
#: node types the examples add around the op (the conv, the Q / DQ pairs, constants, the mul of
#: the add example, the grid's own slicing) and the op's own export does not claim
_AROUND = {"Conv", "QuantizeLinear", "DequantizeLinear", "Constant"}
_ALSO = {"add": {"Mul"}, "cat": {"Mul"}, "grid_sample": {"Slice", "Transpose", "Tanh"}, "batchnorm": {"Relu"}}


@pytest.mark.parametrize("name,make,shape", _EXPORTS, ids=[f"{n}-{k}" for k, (n, _, _) in enumerate(_EXPORTS)])
def test_the_exporter_writes_the_declared_nodes(name, make, shape):
    """Each op exported alone (after a quantized conv, int8_balanced, the default opset): the node
    types the file holds besides the example's own are among the entry's ``onnx``, and at least
    one of them is there."""
    torch.manual_seed(0)
    x = torch.randint(0, 16, (2, 5)) if shape is None else torch.randn(*shape)
    model = dal.prepare_qat(make(), recipe="int8_balanced", example_inputs=(x,))
    dal.calibrate(model, [(x,)], progress=False)
    written = {n.op_type for n in dal.export_onnx(model, (x,)).graph.node}
    own = written - _AROUND - _ALSO.get(name, set())
    declared = set(dal.ops.get(name).onnx)
    assert own and own <= declared, (name, sorted(own), sorted(declared))
