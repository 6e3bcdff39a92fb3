"""Shape-arithmetic and data-movement ops that transformer exports carry (vit, swin), against
onnx.reference, and a whole quantized swin_t export against onnxruntime."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
import dal.npu
from oracles import lsb_diff, output_scale, run_ort, run_reference


def _single(op, inputs, attrs=None, out_type=TensorProto.FLOAT):
    names = [f"i{k}" for k in range(len(inputs))]
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in zip(names, inputs)]
    node = helper.make_node(op, names, ["y"], **(attrs or {}))
    graph = helper.make_graph([node], op, [], [helper.make_tensor_value_info("y", out_type, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


CASES = [
    ("Pad", [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 0, 2, 3], np.int64), np.float32(7)], {}),
    ("Pad", [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([0, 1, 0, 1], np.int64)], {"mode": "reflect"}),
    ("ScatterND", [np.zeros((4, 3), np.float32), np.array([[1], [3]], np.int64), np.ones((2, 3), np.float32)], {}),
    ("ConstantOfShape", [np.array([2, 3], np.int64)], {"value": numpy_helper.from_array(np.array([5], np.int64))}),
    ("Mod", [np.array([-7, 7, 5], np.int64), np.array([3, -3, 2], np.int64)], {}),
    ("Mod", [np.array([-7.5, 7.5], np.float32), np.array([2.0, -2.0], np.float32)], {"fmod": 1}),
    ("Where", [np.array([True, False, True]), np.array([1, 2, 3], np.float32), np.array([9, 8, 7], np.float32)], {}),
    ("Expand", [np.array([[1], [2]], np.float32), np.array([2, 3], np.int64)], {}),
    ("Range", [np.int64(1), np.int64(10), np.int64(3)], {}),
    ("Equal", [np.array([1, 2, 3], np.int64), np.array([1, 0, 3], np.int64)], {}),
    ("Tile", [np.array([[1, 2]], np.float32), np.array([2, 2], np.int64)], {}),
]


@pytest.mark.parametrize("op,inputs,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_op_matches_onnx_reference(op, inputs, attrs):
    model = _single(op, inputs, attrs, out_type=TensorProto.UNDEFINED)
    expected = run_reference(model, {})[0]
    got = dal.npu.run(model, {})[0]
    assert got.dtype == expected.dtype and np.array_equal(got, expected)


@pytest.mark.slow
def test_quantized_swin_export_runs_on_the_npu_reference(tmp_path):
    """swin_t end to end on dal.npu vs onnxruntime (optimizations off), in LSB of the output scale.

    Not bit exact, and the test says why instead of pretending: between the quantized matmuls,
    swin's softmax, layer norms and GELU run in float; the NPU reference sums them in float64 and
    rounds once, onnxruntime sums in float32 in its own order. A last-bit difference that lands
    next to a rounding tie flips one code, and random weights amplify that through 12 blocks
    (the exporter tests see the same drift between torch and onnxruntime). Per quantized layer
    the kernels are bit exact (test_fast_paths, test_torchvision)."""
    import torch
    import torchvision

    import dal

    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    q = dal.prepare_qat(torchvision.models.swin_t(weights=None).eval(), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(q, [torch.randn(1, 3, 64, 64)], progress=False)
    dal.set_quantizer_state(q, "frozen")
    path = tmp_path / "swin.onnx"
    dal.export_onnx(q, (x,), path)
    ref = run_ort(path, {"input": x.numpy()})[0]
    out = dal.npu.run(str(path), {"input": x.numpy()})[0]
    steps = lsb_diff(out, ref, output_scale(path))  # in LSB of the output DequantizeLinear's scale
    print(f"swin_t NPU vs onnxruntime: identical {int((steps == 0).sum())}/{steps.size}, "
          f"within 1 LSB {int((steps <= 1).sum())}, max {steps.max()} LSB")
    # Measured here: 313 identical, 767 within 1 LSB, max 4 LSB; the first divergence (dal.verify) is one
    # code of 24576 at features.2.reduction.input_quant, growing block by block from there.
    assert steps.max() <= 4 and (steps <= 1).mean() >= 0.7


def _split_model(x: np.ndarray, k: int, opset: int, split=None, attrs=None):
    """One Split of input ``x`` into ``k`` outputs; ``split`` as the second input (opset >= 13)
    or the attribute (opset 11)."""
    inputs = ["x"] + (["s"] if split is not None and opset >= 13 else [])
    inits = [numpy_helper.from_array(np.asarray(split, np.int64), "s")] if len(inputs) == 2 else []
    attrs = dict(attrs or {})
    if split is not None and opset < 13:
        attrs["split"] = list(split)
    node = helper.make_node("Split", inputs, [f"y{i}" for i in range(k)], **attrs)
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    graph = helper.make_graph([node], "split", [helper.make_tensor_value_info("x", elem, x.shape)],
                              [helper.make_tensor_value_info(f"y{i}", elem, None) for i in range(k)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


SPLITS = [  # (k, opset, split sizes, attributes): timm's MixNet / CSPNet / attention qkv exports
    (3, 13, [1, 3, 2], {"axis": 1}),
    (2, 11, [4, 2], {"axis": 1}),
    (3, 13, None, {"axis": -1}),            # equal parts
    (3, 18, None, {"axis": 1, "num_outputs": 3}),  # 6 = 2 + 2 + 2
    (3, 18, None, {"axis": 2, "num_outputs": 3}),  # 5 = 2 + 2 + 1 (the last part smaller)
]


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
@pytest.mark.parametrize("k,opset,split,attrs", SPLITS)
def test_split_matches_onnxruntime(k, opset, split, attrs, dtype):
    x = (np.arange(2 * 6 * 5 * 6) % 97 - 40).reshape(2, 6, 5, 6).astype(dtype)
    model = _split_model(x, k, opset, split, attrs)
    want = run_ort(model, {"x": x})
    got = dal.npu.run(model, {"x": x})
    assert len(got) == len(want) == k
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)


def test_split_sizes_that_do_not_add_up_are_refused_by_node():
    x = np.zeros((1, 6), np.float32)
    model = _split_model(x, 2, 13, [2, 3], {"axis": 1})
    with pytest.raises(dal.npu.NPUError, match="Split of 6 along axis 1 into \\[2, 3\\]"):
        dal.npu.run(model, {"x": x})
