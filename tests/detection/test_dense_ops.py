"""dal.npu runs what detectors and segmenters export besides convolutions: an unfolded
BatchNormalization, InstanceNormalization (GroupNorm's export), and linear and cubic Resize in
every coordinate mode torch exports; each single-op graph checked against onnxruntime
(optimizations off) and, for Resize, torch's own F.interpolate in float64."""
import io

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from oracles import run_ort

import dal.npu

RNG = np.random.default_rng(0)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _graph(node, inputs, inits, out_shape, opset=17):
    g = helper.make_graph([node], "one", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, out_shape)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _npu(model, feeds):
    return dal.npu.load(model, semantics="onnx").run(feeds)[0]


def _close(a, b):
    # float64 rounded once (dal.npu) against float32 in onnxruntime's order: a few ulp
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * float(np.abs(b).max()))


def test_batchnormalization_matches_onnxruntime():
    x = RNG.normal(size=(2, 5, 6, 7)).astype(np.float32) * 3 + 1
    c = 5
    inits = {"s": RNG.normal(size=c).astype(np.float32), "b": RNG.normal(size=c).astype(np.float32),
             "m": RNG.normal(size=c).astype(np.float32), "v": RNG.uniform(0.1, 4, size=c).astype(np.float32)}
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)
    model = _graph(node, [("x", x.shape)], inits, x.shape)
    _close(_npu(model, {"x": x}), run_ort(model, {"x": x})[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_instancenormalization_matches_onnxruntime(dtype):
    x = (RNG.normal(size=(2, 4, 5, 6)) * 2 + 0.5).astype(dtype)
    inits = {"s": RNG.normal(size=4).astype(dtype), "b": RNG.normal(size=4).astype(dtype)}
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    node = helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-5)
    g = helper.make_graph([node], "one", [helper.make_tensor_value_info("x", elem, x.shape)],
                          [helper.make_tensor_value_info("y", elem, x.shape)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    mine, ort = _npu(model, {"x": x}), run_ort(model, {"x": x})[0]
    assert mine.dtype == ort.dtype == dtype
    if dtype == np.float16:  # both round to float16 at the end: at most one float16 ulp apart
        ulp = np.spacing(np.abs(ort).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(mine.astype(np.float32) - ort.astype(np.float32)) <= ulp)
    else:
        _close(mine, ort)


# linear; cubic with torch's kernel constant, and with another one and the taps outside excluded
RESIZE_MODES = [("linear", {}), ("cubic", {"cubic_coeff_a": -0.75}),
                ("cubic", {"cubic_coeff_a": -0.5, "exclude_outside": 1})]


@pytest.mark.parametrize("ctm", ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"])
@pytest.mark.parametrize("shape_out", [(12, 14), (3, 5), (1, 9)])
@pytest.mark.parametrize("mode,attrs", RESIZE_MODES)
def test_resize_every_coordinate_mode_matches_onnxruntime(ctm, shape_out, mode, attrs):
    x = RNG.normal(size=(1, 2, 6, 7)).astype(np.float32)
    sizes = np.array([1, 2, *shape_out], dtype=np.int64)
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode=mode, coordinate_transformation_mode=ctm,
                            **attrs)
    model = _graph(node, [("x", x.shape)], {"sizes": sizes}, [1, 2, *shape_out], opset=13)
    _close(_npu(model, {"x": x}), run_ort(model, {"x": x})[0])


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("how", [{"scale_factor": 2.0}, {"size": (13, 9)}])
@pytest.mark.parametrize("mode,onnx_mode", [("bilinear", b"linear"), ("bicubic", b"cubic")])
def test_torch_exported_resize_matches_onnxruntime_and_torch(align_corners, how, mode, onnx_mode):
    class Up(torch.nn.Module):
        def forward(self, x):
            return F.interpolate(x, mode=mode, align_corners=align_corners, **how)

    x = torch.randn(1, 3, 6, 5, generator=torch.Generator().manual_seed(1))
    buf = io.BytesIO()
    torch.onnx.export(Up(), (x,), buf, dynamo=False, opset_version=17, input_names=["x"])
    model = onnx.load_from_string(buf.getvalue())
    resize = next(n for n in model.graph.node if n.op_type == "Resize")
    assert helper.get_attribute_value(next(a for a in resize.attribute if a.name == "mode")) == onnx_mode
    mine = _npu(model, {"x": x.numpy()})
    _close(mine, run_ort(model, {"x": x.numpy()})[0])
    torch64 = F.interpolate(x.double(), mode=mode, align_corners=align_corners, **how).numpy()
    np.testing.assert_allclose(mine, torch64.astype(np.float32), rtol=0, atol=1e-6)



@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_of_an_empty_axis_is_refused_by_node(mode):
    sizes = np.array([1, 1, 2, 4], dtype=np.int64)
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode=mode, name="up")
    model = _graph(node, [("x", [1, 1, 0, 4])], {"sizes": sizes}, [1, 1, 2, 4], opset=13)
    with pytest.raises(dal.npu.NPUError, match="node 'up': Resize of an empty axis"):
        _npu(model, {"x": np.zeros((1, 1, 0, 4), np.float32)})
