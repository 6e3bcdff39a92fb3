"""Oracles the NPU reference is compared with: onnx.reference and onnxruntime (ORT_DISABLE_ALL),
each returning every named tensor of the graph."""
from __future__ import annotations

import onnx


def all_tensor_names(model):
    return [o for n in model.graph.node for o in n.output if o]


def raise_opset(model, minimum=19):
    """onnx.reference has Q/DQ only from opset 19; int8 Q/DQ semantics are unchanged since 13."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx") and o.version < minimum:
            o.version = minimum
    return m


def ort_values(model, feed):
    import onnxruntime as ort
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = all_tensor_names(m)
    have = {o.name for o in m.graph.output}
    for nme in names:
        if nme not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(nme))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    outs = s.run(None, feed)
    return dict(zip([o.name for o in s.get_outputs()], outs))


def ref_values(model, feed):
    from onnx.reference import ReferenceEvaluator
    m = raise_opset(model)
    names = all_tensor_names(m)
    outs = ReferenceEvaluator(m).run(names, feed)
    return dict(zip(names, outs))


def q_names(model):
    return [n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"]
