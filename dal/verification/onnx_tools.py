"""What verify needs to read from an ONNX file: output scales, intermediate values via onnxruntime."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

# Element types onnxruntime's Python API can hand back as numpy arrays.
_NUMPY_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.INT16,
                onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL}


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
    without VNNI) returning the graph outputs and every intermediate it can hand back."""
    ort = require_onnxruntime()
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)}
    extra = onnx.ModelProto()
    extra.CopyFrom(model)
    existing = {o.name for o in extra.graph.output}
    names = []
    for node in extra.graph.node:
        for out in node.output:
            if out and out not in existing and types.get(out) in _NUMPY_TYPES:
                extra.graph.output.append(onnx.helper.make_tensor_value_info(out, types[out], None))
                names.append(out)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(extra.SerializeToString(), so, providers=["CPUExecutionProvider"])
    results = sess.run(None, feed)
    n_out = len(model.graph.output)
    return results[:n_out], dict(zip(names, results[n_out:]))
