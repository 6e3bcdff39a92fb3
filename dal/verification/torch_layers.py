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
from .onnx_tools import constants
from .report import LayerParity


def activation_points(model: onnx.ModelProto) -> dict[str, tuple[str, float, int]]:
    """``{quantizer path: (QuantizeLinear output, scale, zero point)}`` for the per-tensor integer
    activation quantizers the file calls exactly once (a quantizer called twice has no single
    point to compare)."""
    consts = constants(model)
    found: dict[str, Optional[tuple[str, float, int]]] = {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or not node.name.endswith("/QuantizeLinear"):
            continue
        qname = node.name[: -len("/QuantizeLinear")]
        scale = consts.get(node.input[1])
        zp = consts.get(node.input[2]) if len(node.input) > 2 else np.zeros((), np.uint8)
        if qname in found or scale is None or zp is None or scale.size != 1 or zp.dtype.kind not in "iu":
            found[qname] = None  # called twice, per channel, or not an integer format
            continue
        found[qname] = (node.output[0], float(scale.reshape(())), int(zp.reshape(())))
    return {k: v for k, v in found.items() if v is not None}


def torch_layers_vs_file(torch_model: torch.nn.Module, model: onnx.ModelProto, inputs: tuple,
                         file_values: dict) -> list[LayerParity]:
    """One row per activation quantizer: torch's codes vs ``file_values`` (the NPU reference's
    integer tensors, by name), torch teacher-forced to the file's values as it runs."""
    modules = dict(torch_model.named_modules())
    rows: list[LayerParity] = []
    hooks = []
    for qname, (tensor, scale, zp) in activation_points(model).items():
        mod = modules.get(qname)
        if mod is None or tensor not in file_values:
            continue

        def hook(mod, args, out, qname=qname, tensor=tensor, scale=scale, zp=zp):
            theirs = np.asarray(file_values[tensor]).astype(np.int64)
            y = out.detach().float().cpu().numpy()
            if y.shape != theirs.shape:
                return None
            mine = np.rint(y.astype(np.float64) / scale).astype(np.int64) + zp
            d = np.abs(mine - theirs)
            rows.append(LayerParity(f"{qname} (torch)", f"{qname}/QuantizeLinear", "QuantizeLinear",
                                    int(d.size), int((d != 0).sum()), float(d.max(initial=0))))
            forced = ((theirs - zp).astype(np.float32) * np.float32(scale)).astype(np.float32)
            return torch.from_numpy(forced).to(device=out.device, dtype=out.dtype)
        hooks.append(mod.register_forward_hook(hook))
    try:
        with eval_mode(torch_model), torch.no_grad():
            torch_model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return rows
