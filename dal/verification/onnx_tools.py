"""What verify needs to read from an ONNX file: output scales, intermediate values via onnxruntime."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

# Element types onnxruntime's Python API can hand back as numpy arrays.
_NUMPY_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.INT16,
                onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL}
#: float8 element types: fed and fetched through OrtValues / a Cast to float32 (ort_run_all)
_FLOAT8 = {onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2, onnx.TensorProto.FLOAT8E4M3FNUZ,
           onnx.TensorProto.FLOAT8E5M2FNUZ}
_FETCHABLE = _NUMPY_TYPES | _FLOAT8
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL, onnx.TensorProto.INT64,
           onnx.TensorProto.INT32}  # not codes


def constants(model: onnx.ModelProto) -> dict:
    """``{name: numpy array}`` of the initializers and of ``Constant`` nodes with a ``value`` tensor."""
    found = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                found[node.output[0]] = numpy_helper.to_array(value)
    return found


def output_lsb(model: onnx.ModelProto, output_name: str) -> Optional[float]:
    """The LSB an output is compared in: the per-tensor scale of the DequantizeLinear producing
    ``output_name``; for a float output (a detection head after Reshape / Concat / Sigmoid, no
    output quantizer) the scale of the last activation DequantizeLinear feeding it, walking back
    through the float ops. When several feed it (a Concat of heads) the smallest scale is used,
    so a real difference is never hidden behind a coarser neighbour's LSB. None when no
    per-tensor activation DQ is upstream (a purely float graph)."""
    consts = constants(model)
    made_by = producers(model)
    frontier, seen, found = [output_name], set(), []
    while frontier:
        nxt = []
        for name in frontier:
            node = made_by.get(name)
            if node is None or name in seen:
                continue
            seen.add(name)
            if node.op_type == "DequantizeLinear":
                if node.input[0] in consts:
                    continue  # a weight or bias: not the activation's grid
                arr = consts.get(node.input[1])
                if arr is not None and arr.size == 1:
                    found.append(float(arr.reshape(-1)[0]))
                continue
            nxt.extend(i for i in node.input if i and i not in consts)
        if found:  # the nearest DQs only: farther ones are other layers' grids
            return min(found)
        frontier = nxt
    return None


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """``{tensor name: the node that outputs it}``."""
    return {out: node for node in model.graph.node for out in node.output}


def require_onnxruntime():
    """The ``onnxruntime`` module, or an ImportError saying which extra installs it."""
    try:
        import onnxruntime
    except ImportError as err:
        raise ImportError("dal.verify compares with onnxruntime, which is not installed: pip install 'dal[ort]' "
                          "(or pass onnxruntime=False to compare the NPU reference with torch only)") from err
    return onnxruntime


def ort_run_all(model: onnx.ModelProto, feed: dict) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """onnxruntime (graph optimizations disabled: its fused int8 kernels are not exact on CPUs
    without VNNI) returning the graph outputs and every intermediate it can hand back (the
    intermediates' dict also holds the graph outputs that are int8 / uint8 / int16 / float8 codes).

    float8 tensors cross onnxruntime's Python API, which takes and returns no float8 numpy
    arrays, as follows: a float8 input (an ``ml_dtypes`` array) is fed as an ``OrtValue`` of its
    raw bytes with the graph input's ONNX element type; a float8 output or intermediate is fetched
    through an added ``Cast(to=FLOAT)`` (exact: every float8e4m3fn / e5m2 value, NaN and inf
    included, is a float32) and cast back with ``ml_dtypes`` (exact: the value is on the grid), so
    the arrays returned hold the very codes onnxruntime computed, as ``ml_dtypes`` float8.
    """
    ort = require_onnxruntime()
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)}
    extra = onnx.ModelProto()
    extra.CopyFrom(model)
    existing = [o.name for o in extra.graph.output]
    names = []
    for node in list(extra.graph.node):
        for out in node.output:
            if out and out not in existing and types.get(out) in _FETCHABLE:
                names.append(out)
    fetch = []  # what onnxruntime hands back for each wanted tensor (a Cast's output for float8)
    for name in existing + names:
        elem = types.get(name)
        if elem in _FLOAT8:
            cast = f"{name}.__dal_verify_float32"
            extra.graph.node.append(onnx.helper.make_node("Cast", [name], [cast], to=onnx.TensorProto.FLOAT,
                                                          name=cast))
            extra.graph.output.append(onnx.helper.make_tensor_value_info(cast, onnx.TensorProto.FLOAT, None))
            fetch.append(cast)
        else:
            if name not in existing:
                extra.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
            fetch.append(name)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(extra.SerializeToString(), so, providers=["CPUExecutionProvider"])
    values = {}
    for vi in model.graph.input:
        if vi.name not in feed:
            continue
        arr = np.ascontiguousarray(feed[vi.name])
        elem = vi.type.tensor_type.elem_type
        values[vi.name] = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint8), elem)
                           if elem in _FLOAT8 else ort.OrtValue.ortvalue_from_numpy(arr))
    results = [v.numpy() for v in sess.run_with_ort_values(fetch, values)]
    for k, name in enumerate(existing + names):
        if types.get(name) in _FLOAT8:
            results[k] = results[k].astype(onnx.helper.tensor_dtype_to_np_dtype(types[name]))
    n_out = len(model.graph.output)
    # a graph output that is codes (a decoder's present_* KV cache) is a layer's tensor too
    coded = {name: results[k] for k, name in enumerate(existing) if types.get(name) in _FETCHABLE - _FLOATS}
    return results[:n_out], {**coded, **dict(zip(names, results[n_out:]))}
