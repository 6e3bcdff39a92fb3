"""Malformed models and inputs always raise a Python exception (NPUError / UnsupportedNode,
both ValueError), never crash the process."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import graphs

X = np.random.default_rng(0).standard_normal((1, 8, 12, 12)).astype(np.float32)


def _conv_with(**attrs):
    m = graphs.conv_model(seed=0)
    conv = [n for n in m.graph.node if n.op_type == "Conv"][0]
    for k, v in attrs.items():
        for a in list(conv.attribute):
            if a.name == k:
                conv.attribute.remove(a)
        conv.attribute.append(helper.make_attribute(k, v))
    return m


def _expect_error(model, feed=None, semantics="integer"):
    import dal.npu as npu
    with pytest.raises(ValueError):
        npu.load(model, semantics=semantics).run(feed if feed is not None else {"x": X})


@pytest.mark.parametrize("semantics", ["integer", "onnx"])
@pytest.mark.parametrize("attrs", [
    {"strides": [-1, 1]}, {"strides": [0, 0]}, {"pads": [1 << 30, 0, 0, 0]}, {"pads": [-3, 0, 0, 0]},
    {"group": 0}, {"group": 3}, {"dilations": [0, 1]}, {"kernel_shape": [5, 5]}, {"pads": [1, 1]},
    {"dilations": [100, 100]}, {"auto_pad": "FOO"}])
def test_absurd_conv_attributes(attrs, semantics, npu_lib):
    _expect_error(_conv_with(**attrs), semantics=semantics)


def test_truncated_and_garbage_files(npu_lib):
    import dal.npu as npu
    data = graphs.conv_model(seed=0).SerializeToString()
    for cut in (0, 1, 10, len(data) // 3, len(data) // 2, len(data) - 7):
        with pytest.raises(ValueError):
            npu.run(data[:cut], {"x": X})
    with pytest.raises(ValueError):
        npu.run(b"\x08\x07garbage" * 50, {"x": X})
    with pytest.raises(ValueError):
        npu.run("/nonexistent/model.onnx", {"x": X})


def test_bad_inputs(npu_lib):
    m = graphs.conv_model(seed=0)
    _expect_error(m, {"x": X.astype(np.float64)})
    _expect_error(m, {"x": X[:, :4]})
    _expect_error(m, {"y": X})
    _expect_error(m, {})


def test_missing_initializer_named(npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=0)
    gone = m.graph.initializer[2].name
    del m.graph.initializer[2]
    with pytest.raises(npu.NPUError, match=gone):
        npu.load(m)


def test_wrong_element_types(npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=0)
    for i, t in enumerate(m.graph.initializer):
        if t.name.startswith("w_"):  # weights as float64: DQ of float64 is not a thing
            m.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(
                onnx.numpy_helper.to_array(t).astype(np.float64), t.name))
    with pytest.raises(npu.UnsupportedNode, match="DequantizeLinear"):
        npu.run(m, {"x": X})


def test_mismatched_weight_shape(npu_lib):
    m = graphs.conv_model(seed=0, cin=8)
    for i, t in enumerate(m.graph.initializer):
        if t.name.startswith("w_"):
            w = onnx.numpy_helper.to_array(t)[:, :5]
            m.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(w), t.name))
    _expect_error(m)
    _expect_error(m, semantics="onnx")


def test_unsupported_node_named(npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=0)
    m.graph.node[-1].op_type = "FancyOp"
    with pytest.raises(npu.UnsupportedNode, match="FancyOp"):
        npu.load(m)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_attribute_mutations(data):
    """Any integer attribute of any node set to a random value: an exception or a result."""
    import dal.npu as npu
    m = graphs.mixed_model(seed=0)
    node = data.draw(st.sampled_from([n for n in m.graph.node if n.attribute]))
    attr = data.draw(st.sampled_from(list(node.attribute)))
    if attr.type == onnx.AttributeProto.INTS:
        vals = data.draw(st.lists(st.integers(-5, 1 << 20), min_size=0, max_size=6))
        del attr.ints[:]
        attr.ints.extend(vals)
    elif attr.type == onnx.AttributeProto.INT:
        attr.i = data.draw(st.integers(-(1 << 40), 1 << 40))
    x = np.random.default_rng(0).standard_normal((1, 4, 16, 16)).astype(np.float32)
    try:
        npu.run(m, {"x": x})
    except ValueError:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 10**6), st.integers(0, 255))
def test_random_byte_flips(pos, byte):
    import dal.npu as npu
    data = bytearray(graphs.conv_model(seed=0).SerializeToString())
    data[pos % len(data)] = byte
    try:
        npu.run(bytes(data), {"x": X})
    except ValueError:
        pass
