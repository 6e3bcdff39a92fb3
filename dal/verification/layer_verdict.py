"""Each layer-by-layer row of dal.verify judged code by code, and named by the layer that computed it.

A row compares one quantized tensor (a ``QuantizeLinear`` output) as two engines computed it from
the same quantized inputs. Every differing code is classified (near_tie.py): a difference of
exactly 1 whose exact value lies within the float32 error bound of the boundary between the two
codes is a *near-tie*; any other difference (1 LSB away from every boundary's reach, more than
1 LSB, or behind an op with no error model) is a *failure*. A row passes when it has no failure.
Behind an FP16 island's output rounding (a ``Cast(to=FLOAT16)`` between the quantizer and the op
that computed its input) one float16 ulp may span several codes of a finer quantizer: there a
differing code is a near-tie when both codes lie within the error bound (float16 rounding
included) of the exact value (``_judge_fp16``); for codes 1 apart that is the same test.

The layer a row belongs to is the op that computed the quantizer's input, walking back through
ops that only move or clip values (Relu, Clip, MaxPool, Flatten, ...): ``add.input_quants.1``
quantizes what ``conv`` computed, so a wrong ``conv`` weight scale is named ``conv``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from .codes import is_code, is_float8, ordinals
from .near_tie import LayerEvaluator, NoBound
from .onnx_tools import producers

#: ops a quantizer's input passes through unchanged in kind: the layer is the op before them
PASS_THROUGH = {"Relu", "Clip", "MaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity",
                "Cast"}  # Cast: an FP16 island's output rounding (float16 and back), not its computation


def judge_codes(evaluator: Optional[LayerEvaluator], q_node, mine, theirs) -> tuple[int, int, str]:
    """(near-ties, failures, note) among the codes where ``mine`` and ``theirs`` differ (module doc).

    ``evaluator`` holds the integer inputs both engines ran from; None (or a layer it cannot
    bound) makes every differing code a failure, ``note`` saying why."""
    a, b = ordinals(mine), ordinals(theirs)  # LSBs; float8 codes: grid steps (codes.py)
    if a.shape != b.shape:
        return 0, int(b.size), f"shapes differ: {a.shape} vs {b.shape}"
    d = np.abs(a - b)
    differ = d != 0
    if not differ.any():
        return 0, 0, ""
    if evaluator is not None and _behind_fp16_cast(evaluator.made_by, q_node):
        return _judge_fp16(evaluator, q_node, a, b, differ)
    ones = d == 1
    beyond = int((d > 1).sum())
    if not ones.any():
        return 0, beyond, ""
    if evaluator is None:
        return 0, beyond + int(ones.sum()), "no evaluator for the near-tie test"
    try:
        v, bound = evaluator.pre_rounding(q_node)
    except NoBound as err:
        return 0, beyond + int(ones.sum()), f"not tested for near-ties: {err}"
    v = np.broadcast_to(v, a.shape)[ones]
    bound = np.broadcast_to(bound, a.shape)[ones]
    if is_float8(mine):  # the boundary between two adjacent float8 codes: their values' midpoint (zp 0)
        boundary = (np.asarray(mine, np.float64)[ones] + np.asarray(theirs, np.float64)[ones]) / 2
    else:
        boundary = np.minimum(a, b)[ones] + 0.5  # the one boundary between the two codes
    near = np.abs(v - boundary) <= bound
    note = ""
    if not near.all():
        k = int(np.argmax(~near))
        note = (f"a 1-LSB difference at {float(v[k]):.6f} codes, {float(abs(v[k] - boundary[k])):.3g} from the "
                f"boundary, beyond its bound {float(bound[k]):.3g}")
    return int(near.sum()), beyond + int((~near).sum()), note


def _behind_fp16_cast(made_by: dict, q_node) -> bool:
    """The quantizer reads an FP16 island's output: a ``Cast(to=FLOAT16)`` lies between it and the
    op that computed its input (through the ops of :data:`PASS_THROUGH`)."""
    node = made_by.get(q_node.input[0])
    while node is not None and node.op_type in PASS_THROUGH:
        if node.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in node.attribute):
            return True
        node = made_by.get(node.input[0])
    return False


def _judge_fp16(evaluator, q_node, a, b, differ) -> tuple[int, int, str]:
    """judge_codes behind an FP16 island's output rounding. One float16 ulp is several codes of a
    finer quantizer (an int16 one after a softmax in fp16: up to 2^-11 / s_y codes), so the two
    engines' float16 roundings of values within float32 error of a float16 tie land codes apart.
    A differing code is a near-tie when both codes are consistent with the exact value ``v``
    within the error bound (which holds the float16 rounding, ``2^-11 |v|``): both rounding
    intervals ``[c - 1/2, c + 1/2]`` lie within ``bound`` of ``v``; for codes 1 apart this is
    the module's test ``|v - boundary| <= bound``."""
    try:
        v, bound = evaluator.pre_rounding(q_node)
    except NoBound as err:
        return 0, int(differ.sum()), f"not tested for near-ties: {err}"
    v = np.broadcast_to(v, a.shape)[differ]
    bound = np.broadcast_to(bound, a.shape)[differ]
    lo, hi = np.minimum(a, b)[differ], np.maximum(a, b)[differ]
    near = (v >= hi - 0.5 - bound) & (v <= lo + 0.5 + bound)
    note = ""
    if not near.all():
        k = int(np.argmax(~near))
        note = (f"codes {int(lo[k])} and {int(hi[k])} (behind an fp16 cast) at {float(v[k]):.6f} codes: not both "
                f"within its bound {float(bound[k]):.3g}")
    return int(near.sum()), int((~near).sum()), note


def layer_of(model: onnx.ModelProto, q_node, made_by: Optional[dict] = None) -> str:
    """The layer whose own computation a quantizer's codes are: its weight quantizer's path for a
    Conv / Gemm / MatMul (``conv`` of ``conv.weight_quant.codes``), else the module path in the
    computing node's name (``/model/add/Add`` -> ``add``, ``/model/blocks.8/mlp/act/Mul_1`` ->
    ``blocks.8.mlp.act``), else that node's name."""
    made_by = made_by if made_by is not None else producers(model)
    node = made_by.get(q_node.input[0])
    while node is not None and node.op_type in PASS_THROUGH:
        node = made_by.get(node.input[0])
    if node is None:
        return q_node.name.rpartition("/")[0] or q_node.name
    if node.op_type in ("Conv", "Gemm", "MatMul", "ConvTranspose") and len(node.input) > 1:
        w = made_by.get(node.input[1])
        if w is not None and w.op_type == "DequantizeLinear" and ".weight_quant.codes" in w.input[0]:
            return w.input[0].split(".weight_quant.codes")[0]
    parts = [p for p in node.name.split("/") if p]
    if len(parts) < 3 or parts[0] != "model":
        return node.name
    path = parts[-2]  # torch's scopes: "/model/stem/stem.0/Conv", "/model/blocks.8/mlp/act/Mul_1"
    for scope in reversed(parts[1:-2]):
        if not path.startswith(scope + "."):
            path = f"{scope}.{path}"
    return path


def dequantized_cosine(mine, theirs, zp) -> float:
    """float64 cosine of two code tensors after ``code - zp`` (a per-tensor scale cancels); 1.0 when both are 0."""
    a = np.asarray(mine, dtype=np.float64) - zp
    b = np.asarray(theirs, dtype=np.float64) - zp
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 1.0 if na == 0 and nb == 0 else float((a * b).sum() / max(na * nb, 1e-300))


def annotate_forced(rows: list, model: onnx.ModelProto, forced: dict, ort_values: dict, feed: dict,
                    requantizer: dict) -> None:
    """Fill each ``layers_forced`` row's near-ties, failures, layer and cosine: the NPU reference
    run from onnxruntime's codes (``forced``) against onnxruntime's own (``ort_values``)."""
    made_by = producers(model)
    codes = {k: v for k, v in ort_values.items() if is_code(v)}
    ev = LayerEvaluator(model, codes, feed, requantizer)
    from .onnx_tools import constants

    consts = constants(model)
    for row in rows:
        node = made_by.get(row.tensor)
        if node is None or node.op_type != "QuantizeLinear":
            continue
        row.layer = layer_of(model, node, made_by)
        zp = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        zp = float(np.asarray(zp).reshape(-1)[0]) if zp is not None and np.size(zp) == 1 else 0.0
        row.cosine = dequantized_cosine(forced[row.tensor], ort_values[row.tensor], zp)
        if row.differ:
            row.near_ties, _, row.note = judge_codes(ev, node, forced[row.tensor], ort_values[row.tensor])


def graph_order(model: onnx.ModelProto) -> dict:
    """``{QuantizeLinear node name: index in the graph}``: how rows of both views are ordered."""
    return {n.name: i for i, n in enumerate(model.graph.node)}


def annotate_float(rows: list, torch_model, inputs: tuple, npu_values: dict, model: onnx.ModelProto) -> None:
    """Each row's ``float_cosine``: float64 cosine of the NPU reference's dequantized codes
    (``(code - zp) * s``) with the torch float model's value at the same quantizer (``torch_model``
    with its quantizers off, torch_layers.float_points), where both are there."""
    from .onnx_tools import constants
    from .torch_layers import float_points

    floats = float_points(torch_model, model, inputs)

    consts = constants(model)
    made_by = producers(model)
    for row in rows:
        tensor = row.tensor if row.tensor in floats else None
        if tensor is None:  # a torch row: the node's output
            node = next((n for n in model.graph.node if n.name == row.node), None)
            tensor = node.output[0] if node is not None else None
        node = made_by.get(tensor) if tensor else None
        if tensor not in floats or tensor not in npu_values or node is None:
            continue
        s = consts.get(node.input[1])
        zp = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros(1)
        if s is None or np.size(s) != 1 or zp is None or np.size(zp) != 1:
            continue
        deq = (np.asarray(npu_values[tensor], dtype=np.float64) - float(zp.reshape(-1)[0])) * float(s.reshape(-1)[0])
        ref = np.asarray(floats[tensor], dtype=np.float64)
        if ref.shape != deq.shape:
            continue
        na, nb = np.linalg.norm(deq), np.linalg.norm(ref)
        row.float_cosine = 1.0 if na == 0 and nb == 0 else float((deq * ref).sum() / max(na * nb, 1e-300))
