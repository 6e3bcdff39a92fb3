"""``dal inspect model.onnx``: what a QDQ file holds, layer by layer, without running it."""
from __future__ import annotations

import json
from collections import Counter

import onnx
from onnx import TensorProto, helper

COMPUTE_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "Concat", "Gather", "AveragePool",
               "GlobalAveragePool", "MaxPool", "Softmax", "LayerNormalization", "Gelu", "Sigmoid", "Tanh",
               "HardSwish", "Resize"}


def _type_name(elem: int) -> str:
    return helper.tensor_dtype_to_string(elem).removeprefix("TensorProto.").lower()


def _dq_info(node, inits) -> dict:
    zp = node.input[2] if len(node.input) > 2 and node.input[2] else None
    src = node.input[0]
    elem = inits[src].data_type if src in inits else (inits[zp].data_type if zp in inits else TensorProto.UINT8)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    scale = inits.get(node.input[1])
    per = "per_tensor"
    if scale is not None and len(scale.dims) >= 1 and scale.dims and max(scale.dims) > 1:
        per = f"per_group({attrs['block_size']})" if attrs.get("block_size") else f"per_channel(axis={attrs.get('axis', 1)})"
    return {"format": _type_name(elem), "granularity": per, "constant": src in inits}


def describe(model: onnx.ModelProto) -> dict:
    """Plain data: opset, metadata, op counts, and for each compute node its input formats."""
    inits = {i.name: i for i in model.graph.initializer}
    made_by = {o: n for n in model.graph.node for o in n.output}
    meta = {p.key: p.value for p in model.metadata_props}
    sparse = json.loads(meta.get("dal.sparse_24", "{}") or "{}")
    layers = []
    for node in model.graph.node:
        if node.op_type not in COMPUTE_OPS:
            continue
        inputs = []
        for name in node.input:
            src = made_by.get(name)
            if src is not None and src.op_type == "DequantizeLinear":
                info = _dq_info(src, inits)
                info["sparse_2to4"] = src.input[0] in sparse
                inputs.append(info)
            elif src is not None and src.op_type == "Cast":
                to = helper.get_attribute_value(src.attribute[0])
                inputs.append({"format": _type_name(to), "granularity": "-", "constant": False})
            elif name in inits:
                inputs.append({"format": _type_name(inits[name].data_type), "granularity": "-", "constant": True})
            else:
                inputs.append({"format": "float", "granularity": "-", "constant": False})
        layers.append({"node": node.name or node.output[0], "op": node.op_type, "inputs": inputs})
    return {
        "opsets": {d.domain or "ai.onnx": d.version for d in model.opset_import},
        "ir_version": model.ir_version,
        "metadata": meta,
        "op_counts": dict(Counter(n.op_type for n in model.graph.node).most_common()),
        "inputs": [(i.name, _type_name(i.type.tensor_type.elem_type)) for i in model.graph.input if i.name not in inits],
        "outputs": [(o.name, _type_name(o.type.tensor_type.elem_type)) for o in model.graph.output],
        "layers": layers,
        "sparse_2to4": sparse,
    }


def format_text(info: dict) -> str:
    """The table ``dal inspect`` prints for :func:`describe`'s data: header lines, then one row per compute node."""
    lines = [f"opsets: {info['opsets']}   IR version {info['ir_version']}",
             f"inputs: {info['inputs']}   outputs: {info['outputs']}"]
    for k, v in info["metadata"].items():
        lines.append(f"metadata {k}: {v}")
    lines.append("ops: " + ", ".join(f"{k} x{v}" for k, v in info["op_counts"].items()))
    lines.append(f"2:4 sparse weights: {len(info['sparse_2to4'])}")
    lines.append("")
    width = max([len(layer["node"]) for layer in info["layers"]] + [4])
    lines.append(f"{'node':<{width}}  {'op':<18} inputs (format/granularity, * = 2:4 sparse, c = constant)")
    for layer in info["layers"]:
        ins = ", ".join(f"{i['format']}/{i['granularity']}{'*' if i.get('sparse_2to4') else ''}"
                        f"{' c' if i['constant'] else ''}" for i in layer["inputs"])
        lines.append(f"{layer['node']:<{width}}  {layer['op']:<18} {ins}")
    return "\n".join(lines)
