"""The torch QAT model against the exported file, one quantized layer at a time.

Every activation quantizer of the torch model has a ``QuantizeLinear`` in the file, named
``<quantizer path>/QuantizeLinear`` (export/SPEC.md). Running the torch model with a forward
hook on each of those quantizers, the hook compares torch's output (as codes: ``round(y / s) +
zp``, exact because ``y`` is a dequantized value) with the codes the NPU reference holds at that
point, then *replaces* torch's output by the NPU's value (``(code - zp) * s`` in float32, what
DequantizeLinear computes). So every row is one layer judged from the same quantized inputs: a
one-LSB near-tie upstream cannot cascade into it (teacher forcing).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import torch
from ..nn.modes import eval_mode
from .codes import is_code, is_float8, ordinals
from .onnx_tools import constants
from .report import LayerParity


def activation_points(model: onnx.ModelProto) -> dict[str, list[tuple[str, float, int]]]:
    """``{quantizer path: [(QuantizeLinear output, scale, zero point) per call]}`` for the per-tensor
    integer and float8 activation quantizers of the file (a float8 one's zero point is 0).

    A quantizer the model calls k times (a detection head shared by the pyramid levels) has k
    nodes, named ``<path>/QuantizeLinear``, ``<path>/QuantizeLinear_1``, ... in the order the
    exporter traced the calls, which is the order the torch forward makes them. A quantizer with
    any per-channel or non-integer call is left out (no single per-tensor code to compare)."""
    consts = constants(model)
    found: dict[str, Optional[dict[int, tuple[str, float, int]]]] = {}
    for node in model.graph.node:
        base, _, call = node.name.rpartition("/QuantizeLinear")
        if node.op_type != "QuantizeLinear" or not base or not (call == "" or call[1:].isdigit() and call[0] == "_"):
            continue
        index = int(call[1:]) if call else 0
        scale = consts.get(node.input[1])
        zp = consts.get(node.input[2]) if len(node.input) > 2 else np.zeros((), np.uint8)
        calls = found.setdefault(base, {})
        if calls is None or scale is None or zp is None or scale.size != 1 or not is_code(zp) or zp.size != 1 \
                or is_float8(zp) and float(zp.reshape(-1)[0].astype(np.float32)) != 0:
            found[base] = None
            continue
        calls[index] = (node.output[0], float(scale.reshape(())), int(ordinals(zp).reshape(())))
    return {k: [v[i] for i in range(len(v))] for k, v in found.items()
            if v is not None and sorted(v) == list(range(len(v)))}


def _wrapper_prefix(modules: dict, points: dict) -> str:
    """``""``, or the path prefix of the exported model inside the module handed to verify (a
    wrapper such as ``DictValues(model)`` names the file's ``conv.input_quant`` ``model.conv.input_quant``)."""
    if not points or any(q in modules for q in points):
        return ""
    q = next(iter(points))
    found = [p[: -len(q)] for p in modules if p.endswith("." + q)]
    return found[0] if len(found) == 1 else ""


def _sharers(modules: dict) -> dict[str, list[torch.nn.Module]]:
    """``{quantizer path: [modules]}`` for modules that requantize with a sibling quantizer's scale and
    zero point without calling it (``shares_calls_of``, e.g. dal.nn.grid_sample.SharedRequant): the
    exporter writes their calls as that quantizer's further calls, so they count with its own."""
    found: dict[str, list] = {}
    for path, mod in modules.items():
        sibling = getattr(mod, "shares_calls_of", None)
        if isinstance(sibling, str) and path:
            found.setdefault(f"{path.rpartition('.')[0]}.{sibling}".lstrip("."), []).append(mod)
    return found


def torch_layers_vs_file(torch_model: torch.nn.Module, model: onnx.ModelProto, inputs: tuple,
                         file_values: dict, feed: Optional[dict] = None,
                         requantizer: Optional[dict] = None) -> list[LayerParity]:
    """One row per activation quantizer: torch's codes vs ``file_values`` (the NPU reference's
    integer tensors, by name), torch teacher-forced to the file's values as it runs. Each row's
    differing codes are judged (layer_verdict.judge_codes: near-ties or failures, from the NPU's
    codes and ``feed``, the graph inputs), its ``layer`` named and its ``cosine`` (float64, of the
    dequantized tensors) given. A module sharing a quantizer's calls (:func:`_sharers`) is hooked with
    it, one count of calls for both, so its output is compared and pinned like the quantizer's."""
    from .layer_verdict import dequantized_cosine, judge_codes, layer_of
    from .near_tie import LayerEvaluator
    from .onnx_tools import producers

    made_by = producers(model)
    evaluator = LayerEvaluator(model, {k: v for k, v in file_values.items() if is_code(v)},
                               feed or {}, requantizer)
    modules = dict(torch_model.named_modules())
    by_quantizer = activation_points(model)
    prefix = _wrapper_prefix(modules, by_quantizer)
    sharers = _sharers(modules)
    rows: list[LayerParity] = []
    hooks = []
    for qname, points in by_quantizer.items():
        mod = modules.get(prefix + qname)
        if mod is None or any(tensor not in file_values for tensor, _, _ in points):
            continue

        def hook(mod, args, out, qname=qname, points=points, calls=[0]):
            k = calls[0]
            calls[0] += 1
            if k >= len(points):
                return None  # torch called it more often than the file: nothing to pair with
            tensor, scale, zp = points[k]
            raw = np.asarray(file_values[tensor])
            y = out.detach().float().cpu().numpy()
            if y.shape != raw.shape:
                return None
            if is_float8(raw):  # y is a float8 value times the scale: y / s rounds back to that code exactly
                mine_codes = (y.astype(np.float64) / scale).astype(raw.dtype)
                mine, theirs = ordinals(mine_codes), ordinals(raw)
            else:
                mine_codes, theirs = np.rint(y.astype(np.float64) / scale).astype(np.int64) + zp, raw.astype(np.int64)
                mine = mine_codes
            d = np.abs(mine - theirs)
            label = qname if len(points) == 1 else f"{qname}[{k}]"
            node = f"{qname}/QuantizeLinear" + (f"_{k}" if k else "")
            row = LayerParity(f"{label} (torch)", node, "QuantizeLinear", int(d.size), int((d != 0).sum()),
                              float(d.max(initial=0)))
            q_node = made_by.get(tensor)
            if q_node is not None:
                row.layer = layer_of(model, q_node, made_by)
                row.cosine = dequantized_cosine(mine_codes, raw, zp)  # float8: of the values (zp 0)
                if row.differ:
                    row.near_ties, _, row.note = judge_codes(evaluator, q_node, mine_codes, raw)
            rows.append(row)
            forced = ((raw.astype(np.float32) - np.float32(zp)) * np.float32(scale)).astype(np.float32)
            return torch.from_numpy(forced).to(device=out.device, dtype=out.dtype)
        hooks += [m.register_forward_hook(hook) for m in [mod] + sharers.get(prefix + qname, [])]
    try:
        with eval_mode(torch_model), torch.no_grad():
            torch_model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return rows


def float_points(torch_model: torch.nn.Module, model: onnx.ModelProto, inputs: tuple) -> dict:
    """``{QuantizeLinear output: float64 array}``: the torch model with every quantizer off (the
    float model) at each activation quantizer of the file, as it runs on ``inputs`` end to end."""
    from ..quantizer import quantizer_states

    modules = dict(torch_model.named_modules())
    by_quantizer = activation_points(model)
    prefix = _wrapper_prefix(modules, by_quantizer)
    found: dict = {}
    hooks = []
    for qname, points in by_quantizer.items():
        mod = modules.get(prefix + qname)
        if mod is None:
            continue

        def hook(mod, args, out, points=points, calls=[0]):
            k = calls[0]
            calls[0] += 1
            if k < len(points) and torch.is_tensor(out):
                found[points[k][0]] = out.detach().double().cpu().numpy()
        hooks.append(mod.register_forward_hook(hook))
    try:
        with quantizer_states(torch_model, "off"), eval_mode(torch_model), torch.no_grad():
            torch_model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return found
