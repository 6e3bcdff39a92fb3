"""RMSNorm, found by what a module computes, and its FP16 form.

Libraries define their own RMSNorm classes (transformers' ``LlamaRMSNorm``, ``Qwen2RMSNorm``,
``MistralRMSNorm``, ...; torch has ``nn.RMSNorm``), so prepare cannot list them. A module is an
RMSNorm with epsilon ``eps`` (:func:`rmsnorm_eps`) when

* it is ``torch.nn.RMSNorm`` with one normalised dimension, or
* it is a leaf defined outside torch and dal with exactly one Parameter, a 1-D ``weight`` of
  size C, and no buffers, and, run once under ``torch.no_grad`` on a fixed probe ``x`` of shape
  ``[2, 3, C]`` (rows of different scale, some far from zero mean, one so small that ``eps``
  dominates), it returns

      y = x / sqrt(mean(x**2, -1) + eps) * weight          (float64 reference)

  within ``1e-5 * (1 + |y|)`` at every element for ``eps`` one of the module's own float
  attributes in (0, 1) (``eps``, ``variance_epsilon``) or float32's machine epsilon
  (``nn.RMSNorm(eps=None)``). A LayerNorm (subtracts the mean) or a Gemma-style ``(1 + w)``
  scale does not match.

:class:`Fp16RMSNorm` is such a module on an FP16 vector engine (prepare builds it where the
hardware runs ``layernorm`` in fp16, ``dal.prepare.check``): input, weight and output rounded to
fp16 with ``FakeQuantizer("fp16")`` (identities until calibration), the normalisation in float32
in between, computed in the input's dtype as transformers does (normalise in float32, cast,
then scale). It keeps the module's own attributes and Parameter objects (``dal.nn.adopt``);
``to_float()`` gives the original class back.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.adopt import adopt, release
from ..nn.base import QATModule
from ..nn.tree import instance_attributes, own_slots
from ..quantizer import FakeQuantizer

TOLERANCE = 1e-5
_CACHE: "weakref.WeakKeyDictionary[nn.Module, Optional[float]]" = weakref.WeakKeyDictionary()


def rmsnorm_eps(module: nn.Module) -> Optional[float]:
    """``eps`` when ``module`` computes an RMSNorm over its last dimension (module doc), else
    None. The answer is kept per module object (its weight may train; its function does not)."""
    if module in _CACHE:
        return _CACHE[module]
    found = _find_eps(module)
    _CACHE[module] = found
    return found


def _find_eps(module: nn.Module) -> Optional[float]:
    if type(module) is nn.RMSNorm:
        if len(module.normalized_shape) != 1:
            return None
        return float(module.eps) if module.eps is not None else float(torch.finfo(torch.float32).eps)
    if type(module).__module__.startswith(("torch.", "dal.")) or own_slots(module).modules or own_slots(module).buffers:
        return None
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if len(params) != 1 or weight is None or weight.dim() != 1 or not weight.is_floating_point():
        return None
    candidates = [v for k, v in instance_attributes(module).items() if isinstance(v, float) and 0 < v < 1 and not k.startswith("_")]
    candidates.append(float(torch.finfo(torch.float32).eps))
    x = _probe(weight.numel())
    try:
        with torch.no_grad():
            y = module(x.to(device=weight.device))
    except Exception:  # noqa: BLE001 - a module that does not take one tensor is no norm
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    y = y.detach().to("cpu", torch.float64)
    x64, w64 = x.double(), weight.detach().to("cpu", torch.float64)
    for eps in candidates:
        want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
        if bool(((y - want).abs() <= TOLERANCE * (1 + want.abs())).all()):
            return float(eps)
    return None


def _probe(c: int) -> torch.Tensor:
    """``[2, 3, c]`` float32: a ramp, the ramp shifted off zero mean and scaled, and rows of
    small magnitude (mean square ~1e-8, where eps of 1e-6 or 1e-5 changes the result)."""
    ramp = torch.linspace(-1.0, 1.0, c, dtype=torch.float64) + 0.25 * torch.cos(torch.arange(c, dtype=torch.float64))
    rows = torch.stack([ramp, 3.0 * ramp + 2.0, 1e-4 * ramp, -0.5 * ramp + 0.1, 1e-3 * (ramp + 1.0), 7.0 * ramp])
    return rows.reshape(2, 3, c).float()


class Fp16RMSNorm(QATModule):
    """``q_out(rms_norm(q_in(x), eps) * q_w(weight))`` with FP16 cast round trips; the module's
    own attributes and Parameters (made by :meth:`from_module`)."""

    op_class = "layernorm"

    @classmethod
    def from_module(cls, mod: nn.Module, name: str = "", eps: Optional[float] = None) -> "Fp16RMSNorm":
        """The FP16 form of RMSNorm ``mod`` (``eps``: :func:`rmsnorm_eps`'s, found if None)."""
        eps = rmsnorm_eps(mod) if eps is None else eps
        if eps is None:
            raise ValueError(f"{name or type(mod).__name__}: {type(mod).__name__} does not compute an RMSNorm "
                             f"(dal.replace.rmsnorm.rmsnorm_eps)")
        q = adopt(cls, mod)
        q.qat_name, q.activation, q.bias_mode, q.rms_eps = name, None, "float", float(eps)
        q.input_quant = FakeQuantizer("fp16", name=f"{name}.input_quant")
        q.weight_quant = FakeQuantizer("fp16", name=f"{name}.weight_quant") if q.weight is not None else None
        q.output_quant = FakeQuantizer("fp16", name=f"{name}.output_quant")
        return q

    def quantizers(self) -> dict:
        return {k: q for k in ("input_quant", "weight_quant", "output_quant") if (q := getattr(self, k)) is not None}

    def to_float(self) -> nn.Module:
        return release(self, drop=("rms_eps",))

    def forward(self, x):
        x = self.input_quant(x)
        h = x.float()
        if torch.jit.is_tracing():  # the exporter has no aten::rms_norm below opset 23: its formula
            y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.rms_eps)).to(x.dtype)
        else:
            y = F.rms_norm(h, (x.shape[-1],), None, self.rms_eps).to(x.dtype)
        if self.weight is not None:
            y = y * self.weight_quant(self.weight)
        return self.output_quant(y)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape) if self.weight is not None else ''}, eps={self.rms_eps}, fp16"
