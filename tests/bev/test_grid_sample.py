"""F.grid_sample trained, exported and run bit-exact (export/SPEC.md §5b).

Oracles: torch's own float ``F.grid_sample`` (float32 for the QAT bound, float64 for the float
island's values and near-ties), onnxruntime with optimizations off (a hand-built
``DQ -> GridSample -> Q`` of the layer alone, fed dal.npu's input codes: layer by layer), and
dal.npu (from the file) against dal.convert (from the torch model), element by element."""
from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
import yaml
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import dal
import dal.npu
from dal.nn.grid_sample import QGridSample
from dal.recipe.errors import RecipeError
from oracles import ort_session

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from convert_common import assert_bit_exact  # noqa: E402

torch.set_num_threads(1)
COMBOS = list(itertools.product(("bilinear", "nearest"), ("zeros", "border"), (False, True)))
S_GRID = 2.0 ** -14
H, W = 10, 12


def _grid(seed: int, on_codes: bool) -> torch.Tensor:
    """(1, 6, 7, 2) in [-1.2, 1.2): a few samples outside the image on every side. ``on_codes``:
    multiples of 2^-14 (the int16 grid quantizer is then exact)."""
    g = torch.rand(1, 6, 7, 2, generator=torch.Generator().manual_seed(seed)) * 2.4 - 1.2
    return torch.round(g / S_GRID) * S_GRID if on_codes else g


class Sampler(nn.Module):
    """conv -> grid_sample at a fixed reference grid -> conv."""

    def __init__(self, mode, padding, align, grid):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.mode, self.padding, self.align = mode, padding, align
        self.register_buffer("grid", grid)

    def forward(self, x):
        y = F.grid_sample(self.c1(x), self.grid, mode=self.mode, padding_mode=self.padding, align_corners=self.align)
        return self.c2(y)


class SampleOnly(nn.Module):
    def __init__(self, mode, padding, align, grid):
        super().__init__()
        self.mode, self.padding, self.align = mode, padding, align
        self.register_buffer("grid", grid)

    def forward(self, x):
        return F.grid_sample(x, self.grid, mode=self.mode, padding_mode=self.padding, align_corners=self.align)


def _calibrated(model, x, hardware="a2000", more: int = 1):
    """prepare_qat (int8_balanced) and calibration on ``x`` and ``more`` random batches."""
    p = dal.prepare_qat(model, recipe="int8_balanced", hardware=hardware)
    g = torch.Generator().manual_seed(1)
    dal.calibrate(p, [x] + [torch.randn(x.shape, generator=g) for _ in range(more)], progress=False)
    return p.eval()


def _layer(p) -> QGridSample:
    return next(m for m in p.modules() if isinstance(m, QGridSample))


@pytest.mark.parametrize("mode,padding,align", COMBOS)
def test_qat_within_quantization_bound(mode, padding, align):
    """QAT output vs torch's float grid_sample, in output LSBs: input and output quantization
    (1/2 LSB each) plus, for bilinear, the grid's half LSB times the largest neighbour difference
    along each axis (pixels per normalized unit: n/2). Nearest samples at a grid on the int16
    codes, where quantizing the grid changes nothing (a coordinate off the codes may round to
    the other pixel: that is no error bound)."""
    torch.manual_seed(0)
    grid = _grid(3, on_codes=mode == "nearest")
    model = SampleOnly(mode, padding, align, grid)
    x = torch.randn(1, 4, H, W)
    ref = model(x)
    p = _calibrated(copy.deepcopy(model), x, more=0)  # x's own range: nothing clips
    q = _layer(p)
    assert q.grid_quant.scale.item() == S_GRID and q.grid_quant.zero_point.item() == 0
    got = p(x)
    s = q.input_quant.scale.item()
    slope = 0.0
    if mode == "bilinear":
        dx = (x[..., :, 1:] - x[..., :, :-1]).abs().max().item()
        dy = (x[..., 1:, :] - x[..., :-1, :]).abs().max().item()
        slope = S_GRID / 2 * (W / 2 * dx + H / 2 * dy)
    lsb = ((got - ref).abs().max().item() - slope) / s
    assert lsb <= 1.0 + 1e-4, f"{lsb} LSB beyond the grid term"
    # the output is on the input's codes: scale and zero point of the input quantizer
    codes = got / s + q.input_quant.zero_point.item()
    assert torch.allclose(codes, torch.round(codes), atol=1e-3)


@pytest.fixture(scope="module")
def exported():
    """Per combo: (qat, proto, npu session, integer model, x) of the conv -> grid_sample -> conv model."""
    out = {}
    for k, (mode, padding, align) in enumerate(COMBOS):
        torch.manual_seed(k)
        model = Sampler(mode, padding, align, _grid(k, on_codes=False))
        x = torch.randn(1, 3, H, W)
        p = _calibrated(model, x)
        proto = dal.export_onnx(p, (x,))
        out[(mode, padding, align)] = (p, proto, dal.npu.load(proto, threads=1), dal.convert(p), x)
    return out


@pytest.mark.parametrize("mode,padding,align", COMBOS)
def test_export_form(exported, mode, padding, align):
    """DQ -> GridSample -> Q -> DQ, the grid DQ(int16 codes, 2^-14, 0), the output Q with the
    input quantizer's scale and zero point initializers, opset 21 (int16)."""
    p, proto, *_ = exported[(mode, padding, align)]
    onnx.checker.check_model(proto, full_check=True)
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) == 21
    nodes = {o: n for n in proto.graph.node for o in n.output}
    users = {}
    for n in proto.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    gs = [n for n in proto.graph.node if n.op_type == "GridSample"]
    assert len(gs) == 1
    gs = gs[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in gs.attribute}
    assert attrs["mode"] == (b"linear" if mode == "bilinear" else b"nearest")
    assert attrs["padding_mode"] == padding.encode() and attrs.get("align_corners", 0) == int(align)
    x_dq, g_dq = nodes[gs.input[0]], nodes[gs.input[1]]
    assert x_dq.op_type == g_dq.op_type == "DequantizeLinear"
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert inits[g_dq.input[0]].dtype == np.int16 and float(inits[g_dq.input[1]]) == S_GRID
    (q_out,) = users[gs.output[0]]
    assert q_out.op_type == "QuantizeLinear" and q_out.input[1:] == x_dq.input[1:]  # the input's scale and zp


@pytest.mark.parametrize("mode,padding,align", COMBOS)
def test_npu_equals_integer_model(exported, mode, padding, align):
    """dal.npu (from the file) == dal.convert (from the torch model): every output element and
    every QuantizeLinear output, on three batches."""
    p, proto, sess, im, x = exported[(mode, padding, align)]
    g = torch.Generator().manual_seed(7)
    assert_bit_exact(im, proto, sess, [x] + [torch.randn(x.shape, generator=g) * 2 for _ in range(2)],
                     f"{mode}/{padding}/{align}")


def _layer_model(x_codes, x_scale, x_zp, g_codes, mode, padding, align):
    """DQ(x codes) -> GridSample(DQ(int16 grid codes)) -> Q(x's scale and zero point), by hand."""
    xt = TensorProto.UINT8 if x_codes.dtype == np.uint8 else TensorProto.INT8
    inits = [numpy_helper.from_array(np.asarray(x_scale, np.float32), "sx"),
             numpy_helper.from_array(np.asarray(x_zp, x_codes.dtype), "zx"),
             numpy_helper.from_array(g_codes.astype(np.int16), "gc"),
             numpy_helper.from_array(np.asarray(S_GRID, np.float32), "sg"),
             numpy_helper.from_array(np.asarray(0, np.int16), "zg")]
    nodes = [helper.make_node("DequantizeLinear", ["xc", "sx", "zx"], ["xf"]),
             helper.make_node("DequantizeLinear", ["gc", "sg", "zg"], ["gf"]),
             helper.make_node("GridSample", ["xf", "gf"], ["yf"], mode="linear" if mode == "bilinear" else "nearest",
                              padding_mode=padding, align_corners=int(align)),
             helper.make_node("QuantizeLinear", ["yf", "sx", "zx"], ["yc"])]
    graph = helper.make_graph(nodes, "gs", [helper.make_tensor_value_info("xc", xt, list(x_codes.shape))],
                              [helper.make_tensor_value_info("yc", xt, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("mode,padding,align", COMBOS)
def test_onnxruntime_within_one_lsb_layer_by_layer(exported, mode, padding, align):
    """The GridSample layer from dal.npu's own input codes: onnxruntime (optimizations off) within
    1 LSB, and each differing code a near-tie: torch's float64 grid_sample of the dequantized
    values lies within float32 error of a rounding boundary. dal.npu's codes equal the rounding
    of that float64 value (torch's op, not dal's) everywhere else."""
    p, proto, sess, im, x = exported[(mode, padding, align)]
    q = _layer(p)
    _, values = sess.run({sess.input_names[0]: x.numpy()}, return_intermediates=True)
    gs = next(n for n in proto.graph.node if n.op_type == "GridSample")
    made = {o: n for n in proto.graph.node for o in n.output}
    x_codes = values[made[gs.input[0]].input[0]]
    out_q = next(n for n in proto.graph.node if gs.output[0] in n.input)
    npu_codes = values[out_q.output[0]].astype(np.int64)
    s, zp = q.input_quant.scale.item(), int(q.input_quant.zero_point.item())
    g_codes = torch.round(q.grid_quant(p.grid) / S_GRID).numpy()
    ort = ort_session(_layer_model(x_codes, s, zp, g_codes, mode, padding, align)).run(None, {"xc": x_codes})[0]
    diff = np.abs(ort.astype(np.int64) - npu_codes)
    assert diff.max() <= 1
    xf = torch.from_numpy((x_codes.astype(np.float32) - np.float32(zp)) * np.float32(s)).double()
    v64 = F.grid_sample(xf, torch.from_numpy(g_codes * S_GRID).double(), mode=mode, padding_mode=padding,
                        align_corners=align).numpy()
    # ONNX QuantizeLinear of torch's float64 grid_sample rounded to float32: dal.npu's codes exactly
    lo, hi = (0, 255) if x_codes.dtype == np.uint8 else (-128, 127)
    want = np.clip(np.rint(v64.astype(np.float32) / np.float32(s)) + zp, lo, hi)
    np.testing.assert_array_equal(npu_codes, want)
    v = v64 / s
    near_tie = np.abs(np.abs(v - np.floor(v)) - 0.5) < 2.0 ** -20 * (1 + np.abs(v))
    assert np.all((diff == 0) | near_tie), f"{int((diff != 0).sum())} codes differ off a near-tie"


def test_a1000_refuses_by_path_and_skip_keeps_float():
    model = Sampler("bilinear", "zeros", False, _grid(0, False))
    with pytest.raises(RecipeError, match=r"grid_sample \(grid_sample\): hardware 'a1000' does not run grid_sample"):
        dal.prepare_qat(copy.deepcopy(model), recipe="int8_balanced", hardware="a1000")
    recipe = yaml.safe_load((Path(dal.__file__).parents[1] / "recipes" / "int8_balanced.yaml").read_text())
    recipe["name"] = "int8_balanced_skip_grid"
    recipe["rules"].insert(0, {"type": "grid_sample", "skip": True})
    p = dal.prepare_qat(copy.deepcopy(model), recipe=recipe, hardware="a1000")
    assert not any(isinstance(m, QGridSample) for m in p.modules())


def test_bad_grid_shape_named(exported):
    p = exported[COMBOS[0]][0]
    layer = _layer(p)
    x = torch.randn(1, 8, H, W)
    for bad in (torch.zeros(1, 6, 7, 3), torch.zeros(2, 6, 7, 2), torch.zeros(6, 7, 2)):
        with pytest.raises(ValueError, match=r"grid_sample: grid must be \(N, H_out, W_out, 2\)"):
            layer(x, bad)


def _node_model(x_shape, g_shape, mode, padding, align):
    nodes = [helper.make_node("GridSample", ["x", "g"], ["y"], name="gs", mode=mode, padding_mode=padding,
                              align_corners=align)]
    graph = helper.make_graph(nodes, "gs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape)),
                                            helper.make_tensor_value_info("g", TensorProto.FLOAT, list(g_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("mode,padding,align", COMBOS)
def test_nan_and_wild_grids(mode, padding, align):
    """A GridSample node fed float grids with NaN, +-inf and huge values: no crash, a NaN
    coordinate samples 0.0, +-inf and 3e38 are outside (zeros) or clamped to the edge (border), and
    every finite coordinate equals torch's float64 grid_sample rounded to float32."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 5, 6)).astype(np.float32)
    g = (rng.standard_normal((1, 8, 9, 2)) * 1.5).astype(np.float32)
    g.reshape(-1)[rng.choice(g.size, 20, replace=False)] = np.nan
    g.reshape(-1)[rng.choice(g.size, 6, replace=False)] = np.inf
    g.reshape(-1)[rng.choice(g.size, 6, replace=False)] = -np.inf
    g.reshape(-1)[rng.choice(g.size, 6, replace=False)] = 3e38
    m = _node_model(x.shape, g.shape, "linear" if mode == "bilinear" else "nearest", padding, int(align))
    y = dal.npu.run(m, {"x": x, "g": g})[0]
    assert y.shape == (1, 3, 8, 9) and np.isfinite(y).all()
    nan = np.isnan(g).any(-1)
    assert (y[:, :, nan[0]] == 0).all()
    finite = np.isfinite(g).all(-1) & (np.abs(g) < 1e6).all(-1)
    ref = F.grid_sample(torch.from_numpy(x).double(), torch.from_numpy(np.where(np.isfinite(g), g, 0)).double(),
                        mode=mode, padding_mode=padding, align_corners=align).float().numpy()
    np.testing.assert_array_equal(y[:, :, finite[0]], ref[:, :, finite[0]])
    huge = ~np.isnan(g).any(-1) & ~finite
    edge = F.grid_sample(torch.from_numpy(x).double(), torch.from_numpy(np.clip(g, -4, 4)).double(), mode=mode,
                         padding_mode=padding, align_corners=align).float().numpy()  # 4: past every edge
    np.testing.assert_array_equal(y[:, :, huge[0]], edge[:, :, huge[0]])
    for bad in ((1, 3, 5), (1, 8, 9, 3)):  # a grid of the wrong shape: a named error
        with pytest.raises(ValueError, match="'gs'"):
            dal.npu.run(_node_model(x.shape, bad, "linear", padding, int(align)),
                        {"x": x, "g": np.zeros(bad, np.float32)})


class Deform(nn.Module):
    """Deformable-style sampling: the grid is a reference grid plus offsets computed by a Linear
    from the features (tanh-bounded), as deformable attention does per query."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.offset = nn.Linear(8, 2)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)
        ref = torch.rand(1, H, W, 2, generator=torch.Generator().manual_seed(5)) * 2.4 - 1.2
        self.register_buffer("ref", ref)

    def forward(self, x):
        f = self.c1(x)
        grid = self.ref + 0.1 * torch.tanh(self.offset(f.permute(0, 2, 3, 1)))
        return self.c2(F.grid_sample(f, grid, mode="bilinear", padding_mode="zeros", align_corners=False))


def test_learned_grid_trains_one_step_and_runs_bit_exact():
    """A grid computed by a Linear: one QAT step gives finite, non-zero gradients to the offset
    Linear and both convs and moves the offsets, the grid quantizer's scale stays 2^-14; then the
    export runs on dal.npu equal to dal.convert on every element (the grid a computed
    Q(int16) -> DQ)."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, H, W)
    p = dal.prepare_qat(Deform(), recipe="int8_balanced", hardware="a2000")
    dal.calibrate(p, [x, torch.randn_like(x)], progress=False)
    p.train()
    opt = torch.optim.SGD(p.parameters(), lr=0.1)
    before = p.offset.weight.detach().clone()
    loss = p(x).square().mean()
    loss.backward()
    grads = [q.grad for q in (p.offset.weight, p.c1.weight, p.c2.weight)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    opt.step()
    assert not torch.equal(before, p.offset.weight)
    assert _layer(p).grid_quant.scale.item() == S_GRID
    p.eval()
    proto = dal.export_onnx(p, (x,))
    gs = next(n for n in proto.graph.node if n.op_type == "GridSample")
    made = {o: n for n in proto.graph.node for o in n.output}
    g_q = made[made[gs.input[1]].input[0]]
    assert g_q.op_type == "QuantizeLinear" and g_q.input[2] in {t.name for t in proto.graph.initializer}
    assert {t.name: t for t in proto.graph.initializer}[g_q.input[2]].data_type == TensorProto.INT16
    sess = dal.npu.load(proto, threads=1)
    assert_bit_exact(dal.convert(p), proto, sess, [x, torch.randn_like(x)], "deform")


class Untraced(nn.Module):
    """A forward torch.fx cannot trace (a branch on a shape): its grid_sample is found by call site."""

    def __init__(self, grid):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.register_buffer("grid", grid)

    def forward(self, x):
        y = self.c1(x)
        if y.shape[1] % 2 == 0:  # a Python branch on a shape: fx cannot trace it, the exporter can
            y = torch.grid_sampler(y, self.grid, 1, 1, True)  # nearest, border, align_corners
        return self.c2(F.grid_sample(y, self.grid, mode="bilinear", padding_mode="zeros", align_corners=False))


def test_call_sites_in_untraced_forward():
    """F.grid_sample and torch.grid_sampler in a forward fx cannot trace become QGridSample call
    sites with the call's mode, padding and align_corners; export and integer engines as above."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, H, W)
    grid = torch.rand(1, H, W, 2, generator=torch.Generator().manual_seed(2)) * 2.4 - 1.2
    p = dal.prepare_qat(Untraced(grid), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    sites = {k: m for k, m in p.dal_sites.items() if isinstance(m, QGridSample)}
    assert sorted((m.mode, m.padding_mode, m.align_corners) for m in sites.values()) == [
        ("bilinear", "zeros", False), ("nearest", "border", True)]
    dal.calibrate(p, [x, torch.randn_like(x)], progress=False)
    p.eval()
    proto = dal.export_onnx(p, (x,))
    assert sum(n.op_type == "GridSample" for n in proto.graph.node) == 2
    assert_bit_exact(dal.convert(p), proto, dal.npu.load(proto, threads=1), [x, torch.randn_like(x)], "sites")


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[-1]])
def test_dal_verify_passes(exported, tmp_path, combo):
    """dal.verify's one verdict on the exported file: integer model == NPU, and the float engines
    (QAT model, onnxruntime) layer by layer within 1 LSB on near-ties only."""
    p, proto, _, _, x = exported[combo]
    path = tmp_path / "gs.onnx"
    onnx.save(proto, str(path))
    rep = dal.verify(str(path), p, (x,))
    assert rep.verdict() and rep.meets_criterion(), rep.verdict_line()


def test_checkpoint_restores_exactly(exported):
    """prepare_qat + load_state_dict restores a calibrated QGridSample (its grid quantizer's
    buffers included): the same outputs bit for bit."""
    p, _, _, _, x = exported[COMBOS[1]]
    fresh = dal.prepare_qat(Sampler(*COMBOS[1], torch.zeros(1, 6, 7, 2)), recipe="int8_balanced", hardware="a2000")
    fresh.load_state_dict(p.state_dict())
    fresh.eval()
    assert torch.equal(fresh(x), p(x))
    assert _layer(fresh).grid_quant.state == _layer(p).grid_quant.state


def test_hardware_declares_the_grid_format():
    """ops.grid_sample.grid_formats: the a2000 lists int16; a model listing only int8 refuses a
    quantized grid_sample by path; grid_sample without grid_formats (or grid_formats on another op
    class) is refused at load."""
    from dal.hardware import load_hardware
    a2000 = load_hardware("a2000")
    assert [f.name for f in a2000.op("grid_sample").grid_formats] == ["int16"]
    doc = a2000.to_dict()
    doc["name"] = "a2000_int8_grid"
    doc["ops"]["grid_sample"]["grid_formats"] = ["int8"]
    with pytest.raises(RecipeError, match=r"grid_sample \(grid_sample\): dal quantizes a grid_sample's grid to int16"):
        dal.prepare_qat(Sampler("bilinear", "zeros", False, _grid(0, False)), recipe="int8_balanced", hardware=doc)
    for op_class, body in (("grid_sample", {k: v for k, v in doc["ops"]["grid_sample"].items() if k != "grid_formats"}),
                           ("add", {**doc["ops"]["add"], "grid_formats": ["int16"]})):
        bad = copy.deepcopy(doc)
        bad["ops"][op_class] = body
        with pytest.raises(ValueError, match="grid_formats is for grid_sample only"):
            load_hardware(bad)


class ConvThenSample(nn.Module):
    def __init__(self, mode, padding, align, grid):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.mode, self.padding, self.align = mode, padding, align
        self.register_buffer("grid", grid)

    def forward(self, x):
        return F.grid_sample(self.c1(x), self.grid, mode=self.mode, padding_mode=self.padding,
                             align_corners=self.align)


@pytest.mark.parametrize("mode,padding,align", [COMBOS[0], COMBOS[3]])
def test_float_grid_sample_left_by_the_recipe(mode, padding, align):
    """A grid_sample a skip rule leaves in float (a float GridSample in the file, here the graph
    output): dal.convert computes it as §5b says (float64, one rounding, dal/convert/float_ops.py),
    equal to dal.npu on every element (with torch's float32 kernel instead, both cases here differ:
    measured by removing the rule)."""
    recipe = yaml.safe_load((Path(dal.__file__).parents[1] / "recipes" / "int8_balanced.yaml").read_text())
    recipe["name"] = "int8_balanced_float_grid"
    recipe["rules"].insert(0, {"type": "grid_sample", "skip": True})
    torch.manual_seed(0)
    x = torch.randn(1, 3, H, W)
    p = dal.prepare_qat(ConvThenSample(mode, padding, align, _grid(1, False)), recipe=recipe, hardware="a2000")
    dal.calibrate(p, [x, torch.randn_like(x)], progress=False)
    p.eval()
    proto = dal.export_onnx(p, (x,))
    assert [n.op_type for n in proto.graph.node][-1] == "GridSample"
    sess = dal.npu.load(proto, threads=1)
    want = sess.run({sess.input_names[0]: x.numpy()})[0]
    assert np.array_equal(dal.convert(p)(x).numpy(), want)


def test_compiles_without_graph_break_and_equals_eager():
    """torch.compile(fullgraph=True) of a QAT model with a QGridSample (training, quantizers
    tracking their ranges): the forward and every gradient equal the eager step's bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, H, W)
    p = _calibrated(Sampler("bilinear", "border", True, _grid(2, False)), x).train()
    eager = copy.deepcopy(p)
    y_c = torch.compile(p, fullgraph=True, backend="aot_eager")(x)
    y_e = eager(x)
    y_c.square().sum().backward()
    y_e.square().sum().backward()
    assert torch.equal(y_c, y_e)
    for (name, a), b in zip(p.named_parameters(), eager.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name
    assert torch.equal(_layer(p).input_quant.scale, _layer(eager).input_quant.scale)
