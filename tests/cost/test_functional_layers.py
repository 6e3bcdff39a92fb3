"""The cost model charges the function calls a model's own forward makes (dal.cost.torch_graph):
``F.adaptive_avg_pool2d``, ``torch.matmul`` / ``@`` and ``x + y`` are layers, named by the module
whose forward calls them; free calls (reshapes, relu) and calls on constants only are not. The
oracles: the element counts of the tensors the test computes itself with torch, MACs from torch's
own FLOP counter, and the exported ONNX file read by the graph-side cost model."""
import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import dal
from dal.cost import estimate
from dal.cost.torch_graph import trace_layers

HW = 8 * 8  # the spatial size of the example input, named by the reshape


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        s = x + y
        s = s + y  # the same call site again: a second layer
        t = s.reshape(-1, 4, HW)
        return s, torch.matmul(t.transpose(1, 2), t)  # between two activations


class FnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = Block()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("pos", torch.arange(4.0))

    def forward(self, x):
        s, a = self.block(F.relu(self.stem(x)))  # relu: free
        p = F.adaptive_avg_pool2d(s, 1).flatten(1)
        scale = (self.pos * 0.25).exp()  # from a buffer only: folded into a constant, no layer
        up = F.interpolate(s[:, :, ::2, ::2], size=s.shape[-2:])  # exported sizes: Shape -> Slice -> Concat
        return (p * scale) @ self.w, a, up  # a data x constant product, then x @ W (a linear layer)


def _oracle(m, x) -> dict:
    """name -> (op class, input elements, output elements), from the test's own torch calls."""
    with torch.no_grad():
        h = F.relu(m.stem(x))
        y = m.block.conv(h)
        s1 = h + y
        s2 = s1 + y
        t = s2.reshape(-1, 4, HW)
        a = torch.matmul(t.transpose(1, 2), t)
        p = F.adaptive_avg_pool2d(s2, 1).flatten(1)
        ps = p * (m.pos * 0.25).exp()
        out = ps @ m.w
        half = s2[:, :, ::2, ::2]
        up = F.interpolate(half, size=s2.shape[-2:])
    return {"block.add": ("add", h.numel() + y.numel(), s1.numel()),
            "block.add#2": ("add", s1.numel() + y.numel(), s2.numel()),
            "block.matmul": ("matmul", 2 * t.numel(), a.numel()),
            "adaptive_avg_pool2d": ("pool", s2.numel(), p.numel() * 1 * 1),
            "mul": ("mul", p.numel(), ps.numel()),      # the constant operand is not an input
            "matmul": ("linear", ps.numel(), out.numel()),
            "interpolate": ("resize", half.numel(), up.numel())}


def _flop_macs(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() // 2  # 2 FLOPs per multiply-accumulate


def test_function_calls_are_layers_with_torchs_element_counts():
    torch.manual_seed(0)
    m, x = FnNet().eval(), torch.randn(2, 3, 8, 8)
    layers = trace_layers(m, (x,))
    expected = _oracle(m, x)
    names = [g.name for g, _ in layers]
    assert names == ["stem", "block.conv", "block.add", "block.add#2", "block.matmul", "adaptive_avg_pool2d",
                     "interpolate", "mul", "matmul"]
    got = {g.name: (g.op_class, g.input_elems, g.output_elems) for g, mod in layers if mod is None}
    assert got == expected
    geoms = {g.name: g for g, _ in layers}
    t = torch.randn(2, 4, HW)
    assert geoms["block.matmul"].macs == _flop_macs(lambda: torch.matmul(t.transpose(1, 2), t)) == 2 * HW * HW * 4
    assert geoms["matmul"].macs == _flop_macs(lambda: torch.randn(2, 4) @ m.w) == 2 * 6 * 4
    assert geoms["matmul"].weight_elems == m.w.numel() and geoms["block.matmul"].weight_elems == 0
    # every multiply-accumulate of the forward is in a layer: torch's counter over the whole model
    assert sum(g.macs for g, _ in layers) == _flop_macs(lambda: m(x))
    assert all(g.macs == 0 for g in geoms.values() if g.op_class in ("add", "mul", "pool"))


W8_CONV_LINEAR = {"name": "conv_linear_only", "rules": [  # the functional ops stay function calls
    {"type": ["conv", "linear"], "weight": {"format": "int8", "granularity": "per_channel", "symmetric": True},
     "input": {"format": "int8"}}]}


def test_function_layers_agree_with_the_exported_graph(tmp_path):
    """The prepared model (modules + record) and its exported file (nodes + element types):
    the same layers by op class, MACs, elements and formats, the same total cycles. Names differ
    (the graph names a functional node by its ONNX scope). The resize's sizes are computed in the
    exported graph (``Shape -> Slice -> Concat``): the graph reader follows them (data propagation)."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    q = dal.prepare_qat(FnNet().eval(), recipe=W8_CONV_LINEAR, hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    path = tmp_path / "fn.onnx"
    dal.export_onnx(q, (x,), str(path))
    a, b = estimate(q, example_inputs=(x,)), estimate(path)

    def rows(est):
        return collections.Counter((r.geom.op_class, r.geom.macs, r.geom.input_elems, r.geom.output_elems,
                                    r.choice.label if r.choice else None) for r in est.rows)

    # prepare made the pooling an FP16 island module; the rest are still the forward's own calls
    assert [g.name for g, mod in trace_layers(q, (x,)) if mod is None] == \
        ["block.add", "block.add#2", "block.matmul", "interpolate", "mul", "matmul"]
    assert rows(a) == rows(b) and len(a.rows) == 9
    assert a.total_cycles == pytest.approx(b.total_cycles)


class _Calls(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x, x)


def test_a_users_function_op_is_charged_by_its_cost_field():
    """A function the user registers is charged as its op's cost says (vector: its elements;
    free: nothing); a matrix op with no MAC formula for a function call is refused, by name."""
    x = torch.randn(2, 3, 5)
    try:
        dal.ops.register(dal.ops.Op("user_atan2", "activation", "float", functions=(torch.atan2,), cost="vector"))
        (geom, mod), = trace_layers(_Calls(torch.atan2), (x,))
        assert (geom.name, geom.op_class, geom.input_elems, geom.output_elems, mod) == \
            ("atan2", "activation", 2 * x.numel(), torch.atan2(x, x).numel(), None)
        dal.ops.unregister("user_atan2")
        dal.ops.register(dal.ops.Op("user_atan2", "activation", "float", functions=(torch.atan2,), cost="free"))
        assert trace_layers(_Calls(torch.atan2), (x,)) == []
        dal.ops.register(dal.ops.Op("user_kron", "conv", "float", functions=(torch.kron,), cost="matrix"))
        with pytest.raises(ValueError, match=r"kron at <root> is op 'user_kron' \(cost='matrix', op class 'conv'\)"):
            trace_layers(_Calls(torch.kron), (x,))
    finally:
        for name in ("user_atan2", "user_kron"):
            if name in {o.name for o in dal.ops.all_ops()}:
                dal.ops.unregister(name)


class _Flat(nn.Module):
    def forward(self, x):
        t = x.flatten(2)  # exported as Reshape(Concat(Slice(Shape(x)), -1)): onnx's inference stops there
        return torch.matmul(t.transpose(1, 2), t)


def test_exported_flatten_shape_is_evaluated(tmp_path):
    """onnx's shape inference (data propagation included) gives the Reshape after ``flatten(2)``
    no shape; the graph reader evaluates the shape arithmetic with onnx.reference and gets the
    MatMul the torch side has. The oracle: torch's own tensors and FLOP counter."""
    x = torch.randn(1, 3, 4, 4)
    q = dal.prepare_qat(_Flat(), recipe=W8_CONV_LINEAR, hardware="a2000", example_inputs=(x,))
    path = tmp_path / "flat.onnx"
    dal.export_onnx(q, (x,), str(path))
    t = x.flatten(2)
    (geom, _), = trace_layers(q, (x,))  # the torch side has the shapes
    assert geom.name == "matmul"
    assert geom.macs == _flop_macs(lambda: torch.matmul(t.transpose(1, 2), t)) == 16 * 16 * 3
    (row,), a = estimate(path).rows, estimate(q, example_inputs=(x,))
    assert (row.geom.op_class, row.geom.macs, row.geom.input_elems, row.geom.output_elems) == \
        ("matmul", geom.macs, 2 * t.numel(), torch.matmul(t.transpose(1, 2), t).numel())
    assert row.cycles == pytest.approx(a.rows[0].cycles)


def test_exported_matmul_of_unknown_shape_is_refused_by_name(tmp_path):
    """A shape read from the graph's data (a Reshape to a shape given as an input) has no value
    before the graph runs: the MatMul after it is refused, naming the node and the values."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"], name="/Reshape"),
         helper.make_node("Transpose", ["r"], ["rt"], name="/Transpose", perm=[0, 2, 1]),
         helper.make_node("MatMul", ["rt", "r"], ["y"], name="/MatMul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    path = tmp_path / "unknown.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    with pytest.raises(ValueError, match=r"MatMul node '/MatMul': the shape of rt, r, y is unknown"):
        estimate(path)
