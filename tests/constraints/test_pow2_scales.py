"""Power-of-two scales: the rounding of log2 s, observers, LSQ on log2 s, and the exported file
(every scale exactly 2^k by its float32 bits; each concat group one scale and zero point)."""
import math

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import dal
from constraints_common import CatNet, export, ort_all
from dal.formats.autograd import pow2_scale_ste
from dal.formats.qparams import power_of_two_scale
from dal.observers import OBSERVERS, make_observer
from dal.formats import PER_TENSOR, per_channel
from dal.quantizer import FakeQuantizer


def is_pow2_f32(a) -> np.ndarray:
    """Mantissa bits all zero and a normal exponent: exactly 2^k (read from the float32 bits)."""
    bits = np.asarray(a, dtype=np.float32).reshape(-1).view(np.uint32)
    return ((bits & 0x007FFFFF) == 0) & (((bits >> 23) & 0xFF) != 0) & ((bits >> 31) == 0)


def test_rounding_of_log2_matches_math():
    rng = np.random.default_rng(0)
    scales = np.concatenate([2.0 ** rng.uniform(-30, 10, 3000), 2.0 ** np.arange(-40, 10)]).astype(np.float32)
    for mode, f in (("cover", math.ceil), ("nearest", round)):
        got = power_of_two_scale(torch.from_numpy(scales), mode).numpy()
        want = np.array([2.0 ** f(math.log2(float(s))) for s in scales], dtype=np.float32)
        assert np.array_equal(got, want), mode
        assert is_pow2_f32(got).all()
    cover = power_of_two_scale(torch.from_numpy(scales), "cover").numpy()
    assert (cover >= scales).all() and (cover < 2 * scales).all()


@pytest.mark.parametrize("name", sorted(OBSERVERS))
@pytest.mark.parametrize("fmt,symmetric", [("int8", True), ("uint8", False)])
def test_every_observer_proposes_powers_of_two(name, fmt, symmetric):
    torch.manual_seed(0)
    for gran in (PER_TENSOR, per_channel(0)):
        if gran.axis is not None and name in ("kl", "percentile"):
            continue  # histogram searches are per tensor (per-channel uses min-max, see calibrate)
        obs = make_observer(name, fmt, gran, symmetric, power_of_two="cover")
        x = torch.randn(8, 64) * torch.linspace(0.1, 3, 8).reshape(8, 1) + 0.3
        for _ in range(2):
            obs(x)
        scale, zp = obs.calculate_qparams()
        assert is_pow2_f32(scale.numpy()).all(), (name, scale)
        if name in ("minmax", "moving_average"):  # cover: the measured range fits the codes
            dims = None if gran.axis is None else 1
            lo = (x.amin() if dims is None else x.amin(dims)).clamp(max=0)
            hi = (x.amax() if dims is None else x.amax(dims)).clamp(min=0)
            need = torch.maximum(-lo, hi) / 127 if symmetric else (hi - lo) / 255
            assert bool((scale >= need * (1 - 1e-6)).all()) and bool((scale < 2 * need).all())


def test_lsq_on_log2_scale_gradient_and_training():
    t = torch.tensor([-3.4, -2.6, -5.0], requires_grad=True)
    s = pow2_scale_ste(t, "nearest")
    assert s.tolist() == [0.125, 0.125, 0.03125]
    s.sum().backward()
    k = torch.round(t.detach()).requires_grad_()
    torch.pow(2.0, k).sum().backward()  # torch's own derivative of 2^k at the rounded point
    assert torch.allclose(t.grad, k.grad)
    # trained: a scale far too large shrinks to a better power of two, and stays one
    torch.manual_seed(0)
    q = FakeQuantizer("int8", per_channel(0), observer="minmax", learnable=True).constrain_power_of_two("nearest")
    x = torch.randn(4, 512)
    q(x)
    q.end_observation("quantize")
    q.set_qparams(torch.full((4,), 0.5), torch.zeros(4, dtype=torch.int32))
    with torch.no_grad():
        loss0 = float(((q(x) - x) ** 2).mean())
    opt = torch.optim.Adam([q.log2_scale], lr=0.05)
    for _ in range(150):
        loss = ((q(x) - x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(((q(x) - x) ** 2).mean()) < loss0 / 50
    assert is_pow2_f32(q.scale.detach().numpy()).all() and bool(torch.isfinite(q.log2_scale).all())
    assert (q.scale <= 2.0 ** -4).all()


def test_fixed_scale_and_rounding_from_the_recipe():
    q = FakeQuantizer("uint8", symmetric=False, observer="minmax", observer_args={"fixed_scale": 0.125})
    q(torch.tensor([-1.0, 3.0]))
    q.end_observation("frozen")
    assert float(q.scale) == 0.125 and int(q.zero_point) == 8
    q = FakeQuantizer("int8", observer="minmax", observer_args={"power_of_two": "nearest"})
    assert q.power_of_two == "nearest"
    with pytest.raises(ValueError, match="allowed: nearest, cover"):
        FakeQuantizer("int8", observer="minmax", observer_args={"power_of_two": "up"})


@pytest.fixture(scope="module")
def cat_file(tmp_path_factory):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    m = dal.prepare_qat(CatNet(), recipe="pow2_int8", hardware="pow2_int8", example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(m, [(torch.randn(2, 3, 8, 8) * (1 + i),) for i in range(3)], progress=False)
    return m, export(m, x, tmp_path_factory.mktemp("pow2") / "cat.onnx")


def test_every_exported_scale_is_a_power_of_two(cat_file):
    _, model = cat_file
    scales = [numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
              and any(i.name == n.input[1] for n in model.graph.node
                      if n.op_type in ("QuantizeLinear", "DequantizeLinear"))]
    assert len(scales) >= 10
    for s in scales:
        assert is_pow2_f32(s).all(), s
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["dal.requantizer"] == '{"kind": "power_of_two", "rounding": "half_even"}'
    assert meta["dal.accumulator"] == '{"bits": 32, "overflow": "saturate"}'


def _qparams(model, name):
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return init[name]


def test_concat_inputs_and_output_share_one_scale_and_zero_point(cat_file):
    m, model = cat_file
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    concats = [n for n in model.graph.node if n.op_type == "Concat"]
    assert concats
    for cat in concats:
        members = [producer[i] for i in cat.input] + [c for c in consumers[cat.output[0]]]
        assert all(n.op_type in ("DequantizeLinear", "QuantizeLinear") for n in members), [n.op_type for n in members]
        params = {(_qparams(model, n.input[1]).tobytes(), _qparams(model, n.input[2]).tobytes()) for n in members}
        assert len(params) == 1, params
    assert m.cat.output_quant is m.cat.input_quants[0] is m.cat.input_quants[1]


def test_a_concat_group_is_calibrated_on_the_union_of_its_ranges():
    """One min-max batch: the group's scale and zero point are those of the union of the two
    inputs' ranges (the formula written out here), not of either input."""
    act = {"format": "uint8", "symmetric": False, "observer": "minmax"}
    recipe = {"name": "minmax_pow2", "rules": [
        {"type": "conv", "weight": {"format": "int8", "symmetric": True, "observer": "minmax"}, "input": act},
        {"type": "cat", "input": act}]}
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    float_model = CatNet()
    with torch.no_grad():
        float_model.b.bias.fill_(-3.0)  # b's outputs mostly negative, a's (ReLU) non-negative
        u = torch.cat([torch.relu(float_model.a(x)), float_model.b(x)], 1)
    m = dal.prepare_qat(float_model, recipe=recipe, hardware="pow2_int8", example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(m, [(x,)], progress=False)
    lo, hi = min(float(u.min()), 0.0), max(float(u.max()), 0.0)
    scale = 2.0 ** math.ceil(math.log2((hi - lo) / 255))
    q = m.cat.output_quant
    assert float(q.scale) == scale
    assert int(q.zero_point) == int(np.clip(-np.rint(lo / scale), 0, 255))
    parts = [u[:, :8], u[:, 8:]]
    alone = [(min(float(p.min()), 0.0), max(float(p.max()), 0.0)) for p in parts]
    assert all((l, h) != (lo, hi) for l, h in alone)  # neither input alone has the group's range


def test_npu_and_onnxruntime_agree_bit_for_bit_on_a_pow2_file(cat_file):
    """Power-of-two scales and a half-even shift: the float graph is exact, so dal.npu's integer
    groups (shift requantizer from the metadata) equal onnxruntime (optimizations off)."""
    import dal.npu
    _, model = cat_file
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    sess = dal.npu.load(model)
    assert sess.requantizer.kind == "power_of_two"
    assert sum(type(s).__name__ == "FusedStep" for s in sess.steps) == 3
    _, own = sess.run({"input": x}, return_intermediates=True)
    ref = ort_all(model, {"input": x})
    qs = [n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    for name in qs:
        assert np.array_equal(own[name], ref[name]), name
