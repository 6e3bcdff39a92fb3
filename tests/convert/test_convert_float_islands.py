"""FP16 regions and float islands (export/SPEC.md §5a, §6): dal.convert and dal.npu implement the
same single-rounding rules, each checked here against a float64 oracle written in numpy from
the spec (products and sums in float64, rounded once with numpy's / ml_dtypes' casts), and
against each other on whole models with FP16 fallback layers, element by element.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import onnx
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import dal
from convert_common import assert_bit_exact, build, random_batches
from dal.nn import QConv2d, QLinear, SimpleLayerSpec
from dal.prepare import set_quantizer_state
from dal_examples.zoo import MnistCNN

torch.set_num_threads(1)
F16 = np.float16


# ---- the oracle: numpy, float64, one rounding per node ------------------------------------
def conv_oracle(x16, w16, b16, pad):
    """f16(sum float64 x16 * w16 + b16) (stride 1), one rounding: im2col with float64 einsum."""
    n, c, h, w = x16.shape
    o, _, kh, kw = w16.shape
    xp = np.pad(x16.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = h + 2 * pad - kh + 1, w + 2 * pad - kw + 1
    cols = np.stack([xp[:, :, i:i + ho, j:j + wo] for i in range(kh) for j in range(kw)], axis=2)
    s = np.einsum("nckhw,ock->nohw", cols, w16.astype(np.float64).reshape(o, c, kh * kw))
    return (s + b16.astype(np.float64).reshape(1, -1, 1, 1)).astype(F16)


def gemm_oracle(x16, w16, b16):
    """f16(float64 x16 @ w16.T + b16), one rounding."""
    return (x16.astype(np.float64) @ w16.astype(np.float64).T + b16.astype(np.float64)).astype(F16)


def _graph(nodes, inits, xshape):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xshape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _region(op, inits, attrs, xshape, tail=None):
    """Cast(FLOAT16) -> op(h, inits...) [-> tail] -> Cast(FLOAT), as the exporter writes a region."""
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node(op, ["h"] + list(inits), ["o16"], **attrs)]
    last = "o16"
    if tail:
        nodes.append(helper.make_node(tail, ["o16"], ["t16"]))
        last = "t16"
    nodes.append(helper.make_node("Cast", [last], ["y"], to=TensorProto.FLOAT))
    return _graph(nodes, inits, xshape)


def _wide(rng, shape, scale=3.0):
    """float32 inputs spread over many binades (so float16 rounding boundaries are hit often)."""
    return (scale * rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))).astype(np.float32)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("seed", [0, 1])
def test_npu_fp16_conv_gemm_matmul_equal_the_float64_oracle(seed):
    import dal.npu
    rng = np.random.default_rng(seed)
    x = _wide(rng, (2, 8, 9, 9), 1.0)
    w, b = rng.standard_normal((6, 8, 3, 3)).astype(F16), rng.standard_normal(6).astype(F16)
    got = dal.npu.run(_region("Conv", {"w": w, "b": b}, {"pads": [1, 1, 1, 1]}, x.shape, "Relu"), {"x": x})[0]
    want = np.maximum(conv_oracle(x.astype(F16), w, b, 1), F16(0)).astype(np.float32)
    assert np.array_equal(_bits(got), _bits(want))
    x2 = _wide(rng, (5, 64), 1.0)
    w2, b2 = rng.standard_normal((7, 64)).astype(F16), rng.standard_normal(7).astype(F16)
    got = dal.npu.run(_region("Gemm", {"w": w2, "c": b2}, {"transB": 1}, x2.shape), {"x": x2})[0]
    assert np.array_equal(_bits(got), _bits(gemm_oracle(x2.astype(F16), w2, b2).astype(np.float32)))
    got = dal.npu.run(_region("MatMul", {"w": w2.T.copy()}, {}, x2.shape), {"x": x2})[0]
    want = (x2.astype(F16).astype(np.float64) @ w2.T.astype(np.float64)).astype(F16).astype(np.float32)
    assert np.array_equal(_bits(got), _bits(want))


def _t64(f):
    """torch's float64 function (an implementation dal.npu's numpy code does not share)."""
    return lambda v: f(torch.from_numpy(np.asarray(v, np.float64))).numpy()


@pytest.mark.parametrize("op,fn", [("Sigmoid", _t64(lambda t: 1.0 / (1.0 + torch.exp(-t)))), ("Tanh", _t64(torch.tanh))])
def test_npu_transcendental_in_fp16_and_fp32_round_once_from_float64(op, fn):
    import dal.npu
    x = _wide(np.random.default_rng(3), (4, 4096), 2.0)
    got16 = dal.npu.run(_region(op, {}, {}, x.shape), {"x": x})[0]
    want16 = fn(x.astype(F16).astype(np.float64)).astype(F16).astype(np.float32)
    assert np.array_equal(_bits(got16), _bits(want16))
    got32 = dal.npu.run(_graph([helper.make_node(op, ["x"], ["y"])], {}, x.shape), {"x": x})[0]
    assert np.array_equal(_bits(got32), _bits(fn(x.astype(np.float64)).astype(np.float32)))


def test_fp16_add_and_bf16_round_trip_are_the_correctly_rounded_casts():
    import dal.npu
    rng = np.random.default_rng(4)
    x = _wide(rng, (3, 5000))
    c = rng.standard_normal(5000).astype(F16)
    got = dal.npu.run(_region("Add", {"c": c}, {}, x.shape), {"x": x})[0]
    # the exact sum of two float16 values (float64 holds it exactly), rounded once to float16
    want = (x.astype(F16).astype(np.float64) + c.astype(np.float64)).astype(F16).astype(np.float32)
    assert np.array_equal(_bits(got), _bits(want))
    bf = _graph([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.BFLOAT16),
                 helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)], {}, x.shape)
    got = dal.npu.run(bf, {"x": x})[0]
    assert np.array_equal(_bits(got), _bits(x.astype(ml_dtypes.bfloat16).astype(np.float32)))


# ---- dal.convert's FP16 layers against the same oracle ---------------------------------------
def _fp16_layer(module, name, activation=None):
    cls = QConv2d if isinstance(module, nn.Conv2d) else QLinear
    q = cls.from_float(module, SimpleLayerSpec(fallback_fp16=True), name, activation=activation)
    set_quantizer_state(q, "frozen")  # as after dal.calibrate (an FP16 cast has nothing to observe)
    return q.eval()


class _Wrap(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def _convert_one(layer, x):
    """The integer model of a one-layer model (no prepare: a hand-built FP16 layer)."""
    from dal.convert.api import IntegerModel
    from dal.convert.api import Requantizer
    from dal.convert.layers import IntegerLayer
    wrap = _Wrap(layer)
    lay = IntegerLayer(layer, "layer", Requantizer())
    wrap.layer = lay
    im = IntegerModel(wrap, {"layer": lay}, Requantizer())
    return im(x)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_convert_fp16_conv_and_linear_equal_the_float64_oracle(seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    conv = _fp16_layer(nn.Conv2d(8, 6, 3, padding=1), "c", activation="relu6")
    x = torch.from_numpy(_wide(rng, (2, 8, 9, 9), 1.0))
    got = _convert_one(conv, x).numpy()
    w16 = conv.weight.detach().numpy().astype(F16)
    b16 = conv.bias.detach().numpy().astype(F16)
    want = np.clip(conv_oracle(x.numpy().astype(F16), w16, b16, 1), F16(0), F16(6)).astype(np.float32)
    assert np.array_equal(_bits(got), _bits(want))
    lin = _fp16_layer(nn.Linear(64, 7), "l")
    x2 = torch.from_numpy(_wide(rng, (5, 64), 1.0))
    got = _convert_one(lin, x2).numpy()
    want = gemm_oracle(x2.numpy().astype(F16), lin.weight.detach().numpy().astype(F16),
                       lin.bias.detach().numpy().astype(F16)).astype(np.float32)
    assert np.array_equal(_bits(got), _bits(want))


def test_convert_float_island_ops_round_once_from_float64():
    from dal.convert.float_ops import NPUFloatOps, mean_f64
    x = torch.from_numpy(_wide(np.random.default_rng(5), (2, 16, 7, 7), 2.0))
    with NPUFloatOps():
        sig, silu, pooled = torch.sigmoid(x), torch.nn.functional.silu(x), torch.nn.functional.adaptive_avg_pool2d(x, 1)
        tanh = torch.tanh(x)
    x64 = x.numpy().astype(np.float64)
    assert np.array_equal(_bits(tanh.numpy()), _bits(np.tanh(x64).astype(np.float32)))
    s64 = (1.0 / (1.0 + np.exp(-x64))).astype(np.float32)
    assert np.array_equal(_bits(sig.numpy()), _bits(s64))
    assert np.array_equal(_bits(silu.numpy()), _bits(x.numpy() * s64))
    want = (x64.sum(axis=(2, 3), keepdims=True) / 49).astype(np.float32)  # one rounding (SPEC §5a)
    assert np.array_equal(_bits(pooled.numpy()), _bits(want))
    assert torch.equal(mean_f64(x, (2, 3), True), pooled)


# ---- whole models with FP16 fallback layers: integer model == dal.npu on every element -------
def _digit_detector():
    from dal_examples.zoo_detection import DigitDetector
    return DigitDetector(width=8)


def _resnet18():
    tv = pytest.importorskip("torchvision")
    return tv.models.resnet18(weights=None)


MODELS = [("mnist_cnn", MnistCNN, (1, 28, 28)), ("digit_detector", _digit_detector, (1, 64, 64)),
          ("resnet18", _resnet18, (3, 32, 32))]


@pytest.mark.parametrize("name,make,shape", MODELS, ids=[m[0] for m in MODELS])
def test_models_with_fp16_layers_bit_exact(name, make, shape):
    """int8_detection keeps the first conv and the heads in FP16 (MnistCNN: stem.0 and head, a
    Gemm; DigitDetector: fpn.stem.0, heat_head.1, box_head.1; resnet18: conv1)."""
    torch.manual_seed(0)
    qat, proto, sess = build(make(), torch.randn((2,) + shape), "a2000", recipe="int8_detection")
    casts = [n for n in proto.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT16]
    halves = [n for n in proto.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")
              and any(i.endswith(".fp16") for i in n.input)]
    assert casts and halves, f"{name}: no FP16 region in the file"
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((3,) + shape, n=3), name)


class _Tokens(nn.Module):
    """A Linear on rank-3 inputs kept in FP16 (exported MatMul + Add: two roundings), then int8."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 12)
        self.act = nn.ReLU()
        self.out = nn.Linear(12, 4)

    def forward(self, x):
        return self.out(self.act(self.proj(x))).mean(1)


def _fallback_recipe(tmp_path, names):
    import yaml
    recipe = yaml.safe_load(open("recipes/int8_balanced.yaml"))
    recipe["name"] = "fp16_" + "_".join(names)
    recipe["rules"] = [{"match": list(names), "fallback": "fp16"}] + recipe["rules"]
    path = tmp_path / "fp16.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_fp16_linear_on_tokens_bit_exact(tmp_path):
    torch.manual_seed(0)
    qat, proto, sess = build(_Tokens(), torch.randn(2, 5, 16), "a2000", recipe=_fallback_recipe(tmp_path, ["proj"]))
    assert any(n.op_type == "MatMul" and any(i.endswith(".fp16") for i in n.input) for n in proto.graph.node)
    assert_bit_exact(dal.convert(qat), proto, sess, random_batches((3, 5, 16), n=3, scale=3.0), "tokens")


def test_a_wrong_fp16_bias_in_the_file_is_caught():
    """One float16 ulp added to each bias value of the exported FP16 stem: integer model vs NPU
    must see it (the integer model reads the bias from the torch model, dal.npu from the file)."""
    import dal.npu
    from convert_common import compare
    torch.manual_seed(0)
    qat, proto, _ = build(MnistCNN(), torch.randn(2, 1, 28, 28), "a2000", recipe="int8_detection")
    conv16 = next(n for n in proto.graph.node if n.op_type == "Conv" and n.input[1].endswith(".fp16"))
    init = next(t for t in proto.graph.initializer if t.name == conv16.input[2])
    b = numpy_helper.to_array(init).copy()
    b = np.nextafter(b, F16(np.inf)).astype(F16)
    init.CopyFrom(numpy_helper.from_array(b, init.name))
    r = compare(dal.convert(qat), proto, dal.npu.load(proto, threads=1), random_batches((3, 1, 28, 28), n=1)[0])
    assert r["code_diff"] > 0 and r["out_diff"] > 0, r


def test_fp16_add_of_two_fp16_activations_bit_exact(tmp_path):
    """MnistCNN's residual ``x + bn(conv(x))`` and that conv in FP16: the Add joins the region
    (float16 inputs, one correctly rounded float16 addition, the QAT module's FP16 output
    quantizer rounding its float32 sum), the Relu after it too."""
    torch.manual_seed(0)
    qat, proto, sess = build(MnistCNN(), torch.randn(2, 1, 28, 28), "a2000", recipe=_fallback_recipe(tmp_path, ["add", "conv"]))
    assert any(n.op_type == "Add" and all(i.endswith(".fp16") for i in n.input) for n in proto.graph.node)
    assert_bit_exact(dal.convert(qat), proto, sess, random_batches((3, 1, 28, 28), n=3), "fp16 add")


class _Upsampler(torch.nn.Module):
    """Bilinear or bicubic Resize inside the network (by a scale factor, between quantizers) and
    at its float outputs (by size, half_pixel and align_corners), as the segmenters export it."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.a = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.b = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        up = torch.nn.functional.interpolate
        y = self.b(up(torch.relu(self.a(x)), scale_factor=2.0, mode=self.mode))
        return (up(y, size=(37, 41), mode=self.mode, align_corners=False),
                up(y, size=(20, 20), mode=self.mode, align_corners=True))


# bilinear on the a2000; bicubic on generic_int8, the bundled model that lists it
@pytest.mark.parametrize("mode,onnx_mode,hardware", [("bilinear", b"linear", "a2000"),
                                                     ("bicubic", b"cubic", "generic_int8")])
def test_resize_float_island_is_bit_exact(tmp_path, mode, onnx_mode, hardware):
    """The float Resize between quantizers and after the last one: dal.convert's float64
    separable form equals dal.npu's on every element (torch's float32 kernel differed on most
    of them); dal.npu is within 1 LSB of onnxruntime layer by layer; and the float64 form is
    within float32 rounding of a float64 oracle, torch's own interpolate on float64 inputs."""
    from dal.convert.float_ops import cubic_resize_f64, linear_resize_f64

    torch.manual_seed(0)
    x = torch.randn(2, 3, 24, 24)
    q = dal.prepare_qat(_Upsampler(mode), recipe="int8_balanced", hardware=hardware, example_inputs=(x,))
    dal.calibrate(q, [torch.randn(2, 3, 24, 24) for _ in range(3)], progress=False)
    dal.prepare.set_quantizer_state(q, "frozen")
    q.eval()
    path = tmp_path / "up.onnx"
    dal.export_onnx(q, (x,), path)
    modes = {onnx.helper.get_attribute_value(a) for n in onnx.load(path).graph.node if n.op_type == "Resize"
             for a in n.attribute if a.name == "mode"}
    assert modes == {onnx_mode}, modes
    for seed in range(2):
        torch.manual_seed(seed)
        report = dal.verify(path, q, (torch.randn(2, 3, 24, 24),))
        assert report.integer.identical, report.integer
        differ, total, worst = report.layer_by_layer()
        assert total and worst <= 1 and report.verdict(), report.verdict_line()
    resize = linear_resize_f64 if mode == "bilinear" else cubic_resize_f64
    y = torch.randn(1, 2, 7, 9)
    for size, corners in (((37, 41), False), ((20, 20), True), ((14, 18), False)):
        ours = resize(y, list(size), [o / i for o, i in zip(size, y.shape[2:])], corners)
        oracle = torch.nn.functional.interpolate(y.double(), size=size, mode=mode, align_corners=corners)
        assert (ours.double() - oracle).abs().max() <= 2.0 ** -23 * oracle.abs().max() * 2


def _bf16_once(x: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16, rounded once to nearest even on the float64 bits (finite values in
    bfloat16's normal range), then an exact ml_dtypes cast. (ml_dtypes' own float64 -> bfloat16
    goes through float32 and rounds twice, so it is no oracle here.)"""
    b = x.view(np.uint64)
    drop = np.uint64(52 - 7)
    mask = (np.uint64(1) << drop) - np.uint64(1)
    low, rem, half = b & ~mask, b & mask, np.uint64(1) << (drop - np.uint64(1))
    up = (rem > half) | ((rem == half) & (((low >> drop) & np.uint64(1)) == 1))
    return (low + np.where(up, mask + np.uint64(1), np.uint64(0))).view(np.float64).astype(ml_dtypes.bfloat16)


def test_float64_rounds_once_to_half_like_numpy_and_ml_dtypes():
    """round_once (the FP16/BF16-region rounding) equals numpy's float64 -> float16 conversion
    and a bit-level round-to-nearest-even to bfloat16 on values a hair off the halfway points
    (where torch's own conversion, through float32, rounds twice), on ties, +-0, +-inf, NaN,
    overflow and underflow."""
    from dal.convert.fp16_region import round_once
    rng = np.random.default_rng(3)
    for dt, p in ((torch.float16, 11), (torch.bfloat16, 8)):
        m = rng.integers(1 << (p - 1), 1 << p, 20000).astype(np.float64)
        e = rng.integers(-12 if p == 11 else -100, 15, 20000).astype(np.float64)
        mid = (m + 0.5) * 2.0 ** (e - (p - 1))  # halfway between two neighbours
        hair = mid * (1 + rng.choice([-1.0, 1.0], 20000) * 2.0 ** -40)  # off by far less than a float32 ulp
        x = np.concatenate([mid, -mid, hair, -hair, rng.standard_normal(20000) * 1e3])
        got = round_once(torch.from_numpy(x), dt).view(torch.int16).numpy()
        want = (x.astype(np.float16) if dt == torch.float16 else _bf16_once(x)).view(np.int16)
        assert np.array_equal(got, want), int((got != want).sum())
        # torch's own conversion rounds twice on these: the reason for round_once
        twice = torch.from_numpy(np.concatenate([hair, -hair])).to(dt).view(torch.int16).numpy()
        assert bool((twice != want[2 * 20000:4 * 20000]).any())
        special = torch.tensor([0.0, -0.0, np.inf, -np.inf, 1e300, -1e300, 1e-300, -1e-300], dtype=torch.float64)
        r = round_once(special, dt).double()
        assert r.tolist() == [0.0, -0.0, np.inf, -np.inf, np.inf, -np.inf, 0.0, -0.0]
        assert [math.copysign(1, v) for v in r.tolist()] == [math.copysign(1, v) for v in special.tolist()]
        assert bool(round_once(torch.tensor([np.nan], dtype=torch.float64), dt).isnan().all())
