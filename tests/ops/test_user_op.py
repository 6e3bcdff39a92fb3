"""A user's operator is one file: tests/ops/clamp_scale_op.py (``y = clamp(x, lo, hi) * s``,
``@dal.ops.register`` on its QAT class, nothing else touched) goes through prepare, QAT,
calibrate, export, dal.verify, dal.convert and dal.estimate. The oracles are dal.npu (the
independent reference: it reads only the ONNX file), onnx's node types, and the estimate of the
same model without the op. The registration is removed after the module (dal.ops.unregister)."""
import dataclasses
import importlib
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import dal
import dal.npu

OP_FILE = Path(__file__).with_name("clamp_scale_op.py")
README = Path(__file__).resolve().parents[2] / "README.md"
SHAPE = (2, 3, 8, 8)


@pytest.fixture(scope="module")
def op():
    """The op file imported (which registers ClampScale); unregistered afterwards."""
    sys.path.insert(0, str(OP_FILE.parent))
    sys.modules.pop("clamp_scale_op", None)
    try:
        yield importlib.import_module("clamp_scale_op")
    finally:
        sys.path.remove(str(OP_FILE.parent))
        sys.modules.pop("clamp_scale_op", None)
        if "ClampScale" in {o.name for o in dal.ops.all_ops()}:
            dal.ops.unregister("ClampScale")


def _net(op=None):
    torch.manual_seed(0)
    mid = op.ClampScale(-1.0, 1.0, 0.5) if op is not None else nn.Identity()  # Identity: free, not a layer
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), mid, nn.Conv2d(8, 4, 1))


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def trained(op):
    """prepare -> calibrate -> 3 QAT steps -> calibrate again -> eval; the losses of the steps."""
    q = dal.prepare_qat(_net(op), recipe="int8_balanced", hardware="a2000", example_inputs=(_batches(1, 0)[0],))
    dal.calibrate(q, _batches(2, 1), progress=False)
    opt = torch.optim.SGD(q.parameters(), lr=0.01)
    q.train()
    losses = []
    for x in _batches(3, 2):
        loss = q(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dal.calibrate(q, _batches(2, 3), progress=False)
    return q.eval(), losses


@pytest.fixture(scope="module")
def exported(trained):
    q, _ = trained
    proto = dal.export_onnx(q, (_batches(1, 4)[0],))
    return proto, dal.npu.load(proto, threads=1)


def test_prepare_swaps_it_for_its_qat_class_and_qat_trains_it(op, trained):
    q, losses = trained
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    assert (rows["1"].type_name, rows["1"].op_class, rows["1"].status) == ("QClampScale", "activation", "quantized")
    assert type(q[1]) is op.QClampScale and dal.ops.by_module(op.ClampScale).qat_module is op.QClampScale
    assert all(math.isfinite(v) for v in losses) and losses[0] != losses[-1]
    quant = q[1].input_quant
    assert quant is not None and quant.initialized and float(quant.scale) > 0  # observed, calibrated


def test_export_writes_clip_and_mul_between_q_and_dq(exported):
    proto, _ = exported
    nodes = list(proto.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumers = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n.op_type)
    clip = next(n for n in nodes if n.op_type == "Clip")
    mul = next(n for n in nodes if n.op_type == "Mul" and n.input[0] == clip.output[0])
    assert producer[clip.input[0]].op_type == "DequantizeLinear"
    assert producer[producer[clip.input[0]].input[0]].op_type == "QuantizeLinear"
    assert consumers[mul.output[0]] == ["QuantizeLinear"]


def test_verify_passes_and_convert_equals_dal_npu_on_every_element(trained, exported):
    q, _ = trained
    proto, sess = exported
    report = dal.verify(proto, q, (_batches(1, 4)[0],))
    assert report.verdict() and report.integer.identical, report.verdict_line()
    im = dal.convert(q)
    q_outs = [n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    for x in _batches(3, 5):
        out, codes = im.run_with_codes(x)
        ref, values = sess.run({sess.input_names[0]: x.numpy()}, return_intermediates=True)
        assert np.array_equal(out.numpy(), ref[0])  # 0 LSB on every output element
        mine = {f"{k}.quantized" + (f"_{i}" if i else ""): c for k, calls in codes.items() for i, c in enumerate(calls)}
        assert set(q_outs) <= set(mine)
        for name in q_outs:  # every quantized tensor the file holds, the op's input and output included
            assert np.array_equal(mine[name].numpy().astype(np.int64), values[name].astype(np.int64)), name


def test_estimate_charges_it_as_a_vector_op_of_its_elements(op, trained):
    q, _ = trained
    x = _batches(1, 6)[0]
    est = dal.estimate(q, "a2000", example_inputs=(x,))
    plain = dal.prepare_qat(_net(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    base = dal.estimate(plain, "a2000", example_inputs=(x,))
    rows = {r.geom.name: r for r in est.rows}
    row = rows.pop("1")
    elements = SHAPE[0] * 8 * SHAPE[2] * SHAPE[3]  # the first conv's output: 8 channels
    assert (row.geom.op_class, row.engine, row.geom.macs) == ("activation", "vector", 0)
    assert row.geom.input_elems == row.geom.output_elems == elements and row.cycles > 0
    # conv MACs = output elements * C_in * k * k: 3x3 from 3 channels, then 1x1 from 8 to 4 channels
    assert [(r.geom.name, r.geom.macs) for r in base.rows] == [("0", elements * 3 * 9), ("2", elements // 2 * 8)]
    assert sorted(rows) == ["0", "2"] and est.total_cycles == pytest.approx(base.total_cycles + row.cycles)
    # the charge comes from the op's cost field: the same op declared free is not charged
    declared = dal.ops.unregister("ClampScale")
    try:
        dal.ops.register(dataclasses.replace(declared, cost="free"))
        assert "1" not in {r.geom.name for r in dal.estimate(q, "a2000", example_inputs=(x,)).rows}
    finally:
        dal.ops.unregister("ClampScale")
        dal.ops.register(declared)


def test_a_second_op_claiming_clamp_scale_is_refused_naming_both(op):
    class QOther(dal.nn.QATModule, op.ClampScale):
        pass

    with pytest.raises(ValueError, match=r"'ClampOther' claims module type ClampScale, which op 'ClampScale'"):
        dal.ops.register(op.ClampScale, name="ClampOther", op_class="activation")(QOther)
    with pytest.raises(ValueError, match=r"op named 'ClampScale' is already registered"):
        dal.ops.register(dal.ops.Op(name="ClampScale", op_class="activation", handling="quantize"))
    assert dal.ops.by_module(op.ClampScale).qat_module is op.QClampScale
    with pytest.raises(TypeError, match="from_float / to_float"):
        dal.ops.register(nn.Hardshrink, op_class="activation")(type("NotQat", (), {}))
    with pytest.raises(ValueError, match="family file"):
        dal.ops.unregister("add")


def test_readme_section_shows_the_op_file():
    section = README.read_text().split("## Your own operator", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert block.startswith(OP_FILE.read_text()), "README's 'Your own operator' block must begin with clamp_scale_op.py"
