"""Independent oracles for QuantizeLinear / DequantizeLinear: onnx.reference and onnxruntime.

One model per (format, rank, granularity, zero point): ``x`` and ``scale`` are inputs, the zero
point is an initializer (it fixes the output element type, and int4 cannot be fed from numpy).
Outputs: ``codes`` (the Q output widened by an exact Cast: int32 for integers, float32 for
FP8, because onnxruntime's Python API cannot return int4 / float8 arrays) and ``deq`` (DQ of
the Q output). Sessions are cached for the whole test session (per xdist worker).
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h

from oracles import ort_session

OPSET = 21


def _zp_tensor(fmt, zp: np.ndarray) -> onnx.TensorProto:
    dims = list(zp.shape)
    if fmt.is_float8:
        return h.make_tensor("zp", fmt.onnx_type, dims, np.zeros(zp.size, np.float32).tolist())
    return h.make_tensor("zp", fmt.onnx_type, dims, zp.astype(np.int64).flatten().tolist())


def build_model(fmt, rank: int, axis, block_size: int, zp: np.ndarray) -> onnx.ModelProto:
    attrs = {}
    if axis is not None:
        attrs["axis"] = axis
    if block_size:
        attrs["block_size"] = block_size
    code_type = T.FLOAT if fmt.is_float8 else T.INT32
    nodes = [
        h.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], **attrs),
        h.make_node("Cast", ["q"], ["codes"], to=code_type),
        h.make_node("DequantizeLinear", ["q", "scale", "zp"], ["deq"], **attrs),
    ]
    graph = h.make_graph(
        nodes, "qdq",
        [h.make_tensor_value_info("x", T.FLOAT, [None] * rank),
         h.make_tensor_value_info("scale", T.FLOAT, list(zp.shape))],
        [h.make_tensor_value_info("codes", code_type, [None] * rank),
         h.make_tensor_value_info("deq", T.FLOAT, [None] * rank)],
        initializer=[_zp_tensor(fmt, zp)])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


@functools.lru_cache(maxsize=256)
def _sessions(fmt, rank, axis, block_size, zp_bytes, zp_shape, zp_dtype):
    from onnx.reference import ReferenceEvaluator

    zp = np.frombuffer(zp_bytes, dtype=zp_dtype).reshape(zp_shape)
    model = build_model(fmt, rank, axis, block_size, zp)
    return ort_session(model), ReferenceEvaluator(model)


def run(oracle: str, fmt, x: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis=None, block_size=0):
    """(codes, deq) from ``oracle`` ("ort" or "ref") for QuantizeLinear then DequantizeLinear."""
    zp = np.ascontiguousarray(zp, dtype=np.int64)
    if oracle == "ort" and block_size and zp.size == 1:
        # onnxruntime treats a one-element scale as per tensor and then refuses block_size;
        # a single block is per-tensor quantization, so ask it that way.
        zp, scale, axis, block_size = zp.reshape(()), np.asarray(scale).reshape(()), None, 0
    sess, ref = _sessions(fmt, x.ndim, axis, block_size, zp.tobytes(), zp.shape, zp.dtype.str)
    feeds = {"x": np.ascontiguousarray(x, np.float32), "scale": np.ascontiguousarray(scale, np.float32)}
    if oracle == "ort":
        return tuple(sess.run(None, feeds))
    codes, deq = ref.run(None, feeds)
    return np.asarray(codes), np.asarray(deq)
