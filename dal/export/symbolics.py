"""ONNX symbolics that dal puts in place of torch's own while it traces (TorchScript exporter).

``torch.linspace``: torch's symbolic (``symbolic_opset9.linspace``) ignores ``dtype``: it computes
``arange(steps) * (end - start) / (steps - 1) + start`` from Python-float constants, in double, and
the exporter's type promotion then casts every tensor the result meets to double. A float32 model
exports with a float64 branch (Hugging Face Deformable-DETR's encoder reference points,
``torch.linspace(0.5, H - 0.5, H, dtype=valid_ratios.dtype)``), whose QuantizeLinear onnx's checker
rejects, and whose values are not torch's. dal's symbolic gives the tensor torch gives: when
``start``, ``end`` and ``steps`` are constants of the trace, the Constant ``torch.linspace(start,
end, steps, dtype=dtype)`` (torch's own values, bit for bit); otherwise torch's double formula
followed by ``Cast`` to ``dtype`` (float32 when ``dtype`` is None, torch's default).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.onnx import symbolic_helper, symbolic_opset9


def _constant(value):
    """The Python value of a traced argument that is a constant of the trace, else None."""
    if not symbolic_helper._is_constant(value):
        return None
    return symbolic_helper._maybe_get_const(value, "t")


def _dtype(value) -> torch.dtype:
    """The torch dtype of a traced ``dtype`` argument (None: torch's default, float32 here)."""
    if symbolic_helper._is_none(value):
        return torch.get_default_dtype()
    code = symbolic_helper._get_const(value, "i", "dtype")
    return symbolic_helper.scalar_type_to_pytorch_type[code]


def linspace(g, start, end, steps, dtype, layout, device, pin_memory):
    """``aten::linspace`` with torch's dtype and, for constant arguments, torch's values."""
    want = _dtype(dtype)
    ends = [_constant(v) for v in (start, end, steps)]
    if all(isinstance(v, torch.Tensor) for v in ends):
        a, b, n = (v.item() for v in ends)
        return g.op("Constant", value_t=torch.linspace(a, b, int(n), dtype=want))
    out = symbolic_opset9.linspace(g, start, end, steps, dtype, layout, device, pin_memory)
    return g.op("Cast", out, to_i=symbolic_helper.scalar_type_to_onnx[
        symbolic_helper.scalar_type_to_pytorch_type.index(want)])


# op -> (torch's symbolic that dal's replaces, dal's)
_OVERRIDES = {"aten::linspace": (symbolic_opset9.linspace, linspace)}


@contextlib.contextmanager
def dal_symbolics(opset: int) -> Iterator[None]:
    """Register dal's symbolics for ``opset`` while tracing; restore torch's afterwards.

    An op whose symbolic at this opset is not torch's own (the user registered one) keeps it.
    """
    from torch.onnx._internal.torchscript_exporter import registration  # where torch keeps them
    added = []
    try:
        for name, (torchs, fn) in _OVERRIDES.items():
            group = registration.registry.get_function_group(name)
            if group is None or group.get(opset) is not torchs:
                continue
            torch.onnx.register_custom_op_symbolic(name, fn, opset)
            added.append(name)
        yield
    finally:
        for name in added:
            torch.onnx.unregister_custom_op_symbolic(name, opset)
