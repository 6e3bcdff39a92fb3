"""The decoder graphs' nodes for the structured fuzzer (fuzz_corpus.py, issue 43): base models (a
blocked INT4 weight MatMul read by a quantizer, the blocked integer group with its options, the
blocked linear with a float output, an int8 key cache concatenated with the new entry, an int8
embedding Gather) and ``decoder_edge``, the mutation kind that hits their own edges."""
from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper, numpy_helper


def _init(m, name):
    return next(t for t in m.graph.initializer if t.name == name)


def _replace(m, name, arr):
    _init(m, name).CopyFrom(numpy_helper.from_array(np.asarray(arr), name))


def blocked_model(seed=6):
    """A decoder's INT4 weight-only linear (opset 21): Q(x) -> DQ, DQ(int4 w [32, 8], blocked along
    axis 0, block_size 16: scale and zero point [2, 8]) -> MatMul -> Q -> DQ."""
    rng = np.random.default_rng(seed)
    arr = [(np.float32(0.05), "s_x"), (np.int8(0), "z_x"),
           (rng.integers(-8, 8, (32, 8)).astype(ml_dtypes.int4), "w_codes"),
           ((rng.random((2, 8)) * 0.05 + 0.01).astype(np.float32), "w_scale"),
           (rng.integers(-2, 3, (2, 8)).astype(ml_dtypes.int4), "w_zp"),
           (np.float32(0.4), "s_y"), (np.int8(0), "z_y")]
    inits = [numpy_helper.from_array(a, n) for a, n in arr]
    mk = helper.make_node
    nodes = [mk("QuantizeLinear", ["x", "s_x", "z_x"], ["x_q"], name="x_q"),
             mk("DequantizeLinear", ["x_q", "s_x", "z_x"], ["x_f"], name="x_dq"),
             mk("DequantizeLinear", ["w_codes", "w_scale", "w_zp"], ["w"], name="w_dq", axis=0, block_size=16),
             mk("MatMul", ["x_f", "w"], ["y"], name="matmul"),
             mk("QuantizeLinear", ["y", "s_y", "z_y"], ["y_q"], name="y_q"),
             mk("DequantizeLinear", ["y_q", "s_y", "z_y"], ["out"], name="y_dq")]
    graph = helper.make_graph(nodes, "blocked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def blocked_group_model(seed=9):
    """export/SPEC.md §5a's blocked integer group with its options: uint8 input codes with a zero
    point, DQ(int4 w [32, 8], axis 0, block_size 12: three blocks, the last of 8 channels, zero
    point [3, 8]) -> MatMul -> Relu -> two QuantizeLinear readers (uint8, int8) -> DQ each."""
    rng = np.random.default_rng(seed)
    arr = [(np.float32(0.05), "s_x"), (np.uint8(120), "z_x"),
           (rng.integers(-8, 8, (32, 8)).astype(ml_dtypes.int4), "w_codes"),
           ((rng.random((3, 8)) * 0.05 + 0.01).astype(np.float32), "w_scale"),
           (rng.integers(-3, 4, (3, 8)).astype(ml_dtypes.int4), "w_zp"),
           (np.float32(0.3), "s_y"), (np.uint8(5), "z_y"), (np.float32(0.7), "s_y2"), (np.int8(-3), "z_y2")]
    inits = [numpy_helper.from_array(a, n) for a, n in arr]
    mk = helper.make_node
    nodes = [mk("QuantizeLinear", ["x", "s_x", "z_x"], ["x_q"], name="x_q"),
             mk("DequantizeLinear", ["x_q", "s_x", "z_x"], ["x_f"], name="x_dq"),
             mk("DequantizeLinear", ["w_codes", "w_scale", "w_zp"], ["w"], name="w_dq", axis=0, block_size=12),
             mk("MatMul", ["x_f", "w"], ["y"], name="matmul"),
             mk("Relu", ["y"], ["y_r"], name="relu"),
             mk("QuantizeLinear", ["y_r", "s_y", "z_y"], ["y_q"], name="y_q"),
             mk("DequantizeLinear", ["y_q", "s_y", "z_y"], ["out"], name="y_dq"),
             mk("QuantizeLinear", ["y_r", "s_y2", "z_y2"], ["y_q2"], name="y_q2"),
             mk("DequantizeLinear", ["y_q2", "s_y2", "z_y2"], ["out2"], name="y_dq2")]
    graph = helper.make_graph(nodes, "blocked_group", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("out", "out2")],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def blocked_float_model(seed=10):
    """export/SPEC.md §5a's blocked linear with a float output: int8 input codes with a zero point,
    DQ(int4 w [32, 8], axis 0, block_size 12: three blocks, the last of 8 channels, zero point
    [3, 8]) -> MatMul, whose output is a graph output and is also read by a float Add (a constant
    bias) that a QuantizeLinear then reads -> DQ."""
    rng = np.random.default_rng(seed)
    arr = [(np.float32(0.05), "s_x"), (np.int8(-7), "z_x"),
           (rng.integers(-8, 8, (32, 8)).astype(ml_dtypes.int4), "w_codes"),
           ((rng.random((3, 8)) * 0.05 + 0.01).astype(np.float32), "w_scale"),
           (rng.integers(-3, 4, (3, 8)).astype(ml_dtypes.int4), "w_zp"),
           (rng.standard_normal(8).astype(np.float32), "bias"), (np.float32(0.3), "s_y"), (np.int8(2), "z_y")]
    inits = [numpy_helper.from_array(a, n) for a, n in arr]
    mk = helper.make_node
    nodes = [mk("QuantizeLinear", ["x", "s_x", "z_x"], ["x_q"], name="x_q"),
             mk("DequantizeLinear", ["x_q", "s_x", "z_x"], ["x_f"], name="x_dq"),
             mk("DequantizeLinear", ["w_codes", "w_scale", "w_zp"], ["w"], name="w_dq", axis=0, block_size=12),
             mk("MatMul", ["x_f", "w"], ["y"], name="matmul"),
             mk("Add", ["bias", "y"], ["y_b"], name="bias_add"),
             mk("QuantizeLinear", ["y_b", "s_y", "z_y"], ["y_q"], name="y_q"),
             mk("DequantizeLinear", ["y_q", "s_y", "z_y"], ["out"], name="y_dq")]
    graph = helper.make_graph(nodes, "blocked_float", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "out")],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def cache_model(seed=7, past=5):
    """A decoder's quantized key cache: int8 codes past_k [1, 2, past, 8] -> DQ -> Concat(axis 2) with
    the new entry (graph input k_new [1, 2, 1, 8] -> Q -> DQ) -> Transpose -> MatMul(q, k^T) -> Q -> DQ,
    q a DQ of int8 codes [1, 2, 1, 8]."""
    rng = np.random.default_rng(seed)
    arr = [(rng.integers(-128, 128, (1, 2, past, 8)).astype(np.int8), "past_k"), (np.float32(0.03), "s_k"),
           (np.int8(0), "z_k"), (rng.integers(-128, 128, (1, 2, 1, 8)).astype(np.int8), "q_codes"),
           (np.float32(0.02), "s_q"), (np.float32(0.05), "s_y"), (np.int8(0), "z_y")]
    inits = [numpy_helper.from_array(a, n) for a, n in arr]
    mk = helper.make_node
    nodes = [mk("DequantizeLinear", ["past_k", "s_k", "z_k"], ["past_f"], name="past_dq"),
             mk("QuantizeLinear", ["k_new", "s_k", "z_k"], ["k_q"], name="k_q"),
             mk("DequantizeLinear", ["k_q", "s_k", "z_k"], ["k_f"], name="k_dq"),
             mk("Concat", ["past_f", "k_f"], ["k_all"], name="cache_concat", axis=2),
             mk("Transpose", ["k_all"], ["k_t"], name="k_transpose", perm=[0, 1, 3, 2]),
             mk("DequantizeLinear", ["q_codes", "s_q", "z_y"], ["q"], name="q_dq"),
             mk("MatMul", ["q", "k_t"], ["scores"], name="qk_matmul"),
             mk("QuantizeLinear", ["scores", "s_y", "z_y"], ["sc_q"], name="scores_q"),
             mk("DequantizeLinear", ["sc_q", "s_y", "z_y"], ["out"], name="scores_dq")]
    graph = helper.make_graph(nodes, "cache", [helper.make_tensor_value_info("k_new", TensorProto.FLOAT, [1, 2, 1, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def embed_model(seed=8):
    """A decoder's int8 embedding table: Gather(table codes [16, 8], ids int64 [3], negative too) -> DQ
    -> Add(x) -> Q -> DQ, x the graph input [3, 8]."""
    rng = np.random.default_rng(seed)
    arr = [(rng.integers(-128, 128, (16, 8)).astype(np.int8), "table"), (np.array([3, -1, 0], np.int64), "ids"),
           (np.float32(0.02), "s_t"), (np.int8(0), "z_t"), (np.float32(0.05), "s_y"), (np.int8(0), "z_y")]
    inits = [numpy_helper.from_array(a, n) for a, n in arr]
    mk = helper.make_node
    nodes = [mk("Gather", ["table", "ids"], ["e_codes"], name="embed_gather", axis=0),
             mk("DequantizeLinear", ["e_codes", "s_t", "z_t"], ["e"], name="embed_dq"),
             mk("Add", ["e", "x"], ["h"], name="embed_add"),
             mk("QuantizeLinear", ["h", "s_y", "z_y"], ["h_q"], name="h_q"),
             mk("DequantizeLinear", ["h_q", "s_y", "z_y"], ["out"], name="h_dq")]
    graph = helper.make_graph(nodes, "embed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


_BLOCK_SIZES = [12, 7, 5, 3, 31, 33, 64, 0, -1, -16, (1 << 31) - 1]


def decoder_edge(m, rng):
    """The decoder graphs' own edges (issue 43): on the blocked INT4 MatMul a block_size that does
    not divide the axis (its scale and zero point resized to ceil(K / block_size), or left as they
    are), 0 or negative, or a scale / zero point one off along either axis; on the key cache a past
    shape one off along any axis or the cache's codes of another type; on the embedding an index
    n, -n - 1, -1 or huge, or of another type. Other models are left as they are."""
    names = {n.name for n in m.graph.node}
    if "w_dq" in names:
        dq = next(n for n in m.graph.node if n.name == "w_dq")
        attr = next(a for a in dq.attribute if a.name == "block_size")
        choice = int(rng.integers(3))
        if choice < 2:
            bs = _BLOCK_SIZES[rng.integers(len(_BLOCK_SIZES))]
            attr.i = bs
            if choice == 0 and bs > 0:  # consistent parameters: a valid file, ceil(32 / bs) blocks
                nb = -(-32 // bs)
                for name in ("w_scale", "w_zp"):
                    arr = numpy_helper.to_array(_init(m, name))
                    _replace(m, name, np.resize(arr, (nb, 8)).astype(arr.dtype))
            return f"block_size={bs}{' resized' if choice == 0 else ''}", ["w_dq", "w_scale", "w_zp", "block"]
        name = ("w_scale", "w_zp")[rng.integers(2)]
        arr = numpy_helper.to_array(_init(m, name))
        ax = int(rng.integers(2))
        shape = list(arr.shape)
        shape[ax] += 1 if rng.integers(2) else -1
        _replace(m, name, np.resize(arr, shape).astype(arr.dtype))
        return f"{name} {shape}", ["w_dq", name]
    if "cache_concat" in names:
        arr = numpy_helper.to_array(_init(m, "past_k"))
        if rng.integers(2):
            ax = int(rng.integers(4))
            shape = list(arr.shape)
            shape[ax] = max(0, shape[ax] + (1 if rng.integers(2) else -1))
            _replace(m, "past_k", np.resize(arr, shape).astype(arr.dtype))
            return f"past_k {shape}", ["past_k", "past_dq", "cache_concat", "k_transpose", "qk_matmul"]
        to = [np.uint8, np.int16, np.int32, np.float32, np.float16, ml_dtypes.int4, np.int64][rng.integers(7)]
        _replace(m, "past_k", arr.astype(to))
        return f"past_k->{np.dtype(to)}", ["past_k", "past_dq", "cache_concat"]
    if "embed_gather" in names:
        arr = numpy_helper.to_array(_init(m, "ids")).copy()
        if rng.integers(4) == 0:
            to = [np.int32, np.float32, np.uint8, np.int8][rng.integers(4)]
            _replace(m, "ids", arr.astype(to))
            return f"ids->{np.dtype(to)}", ["embed_gather", "ids"]
        v = [16, -17, -1, 15, 1 << 40, -(1 << 62), 1000][rng.integers(7)]
        arr[rng.integers(arr.size)] = v
        _replace(m, "ids", arr)
        return f"ids={arr.tolist()}", ["embed_gather", "ids"]
    return "not a decoder model", []
