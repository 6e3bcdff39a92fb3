"""What every QAT module shares: its quantizers, the int32 bias convention, fused activations."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..formats import INT32, fake_quantize
from ..quantizer import FakeQuantizer
from .spec import make_quantizer

ACTIVATIONS = (None, "relu", "relu6")


def apply_activation(y: torch.Tensor, activation) -> torch.Tensor:
    """Fused output activation: None, "relu", "relu6" or ("clip", lo, hi)."""
    if activation is None:
        return y
    if activation == "relu":
        return F.relu(y)
    if activation == "relu6":
        return F.hardtanh(y, 0.0, 6.0)
    if isinstance(activation, tuple) and activation[0] == "clip":
        return torch.clamp(y, activation[1], activation[2])
    raise ValueError(f"activation={activation!r} is not one of None, 'relu', 'relu6', ('clip', lo, hi)")


def _per_channel_copy(spec):
    from .spec import SimpleTensorSpec

    return SimpleTensorSpec(spec.format, "per_channel", None, None, spec.symmetric, spec.narrow_range,
                            spec.observer, getattr(spec, "observer_args", ()), spec.learnable)


def _active_integer(q: Optional[FakeQuantizer]) -> bool:
    return q is not None and q.fmt.is_integer and q.state in ("quantize", "frozen") and q.initialized


class QATMixin:
    """Mixed into each QAT module (before the torch base class).

    Attributes: ``input_quant``, ``weight_quant``, ``output_quant`` (FakeQuantizer or None),
    ``activation`` (fused, applied before ``output_quant``), ``bias_mode`` ("int32" or "float").

    Bias convention (the one integer hardware uses, and the exporter writes): when input and
    weight are integer-quantized, the bias is fake-quantized to int32 with
    ``scale = float32(s_in) * float32(s_w)`` (per output channel when the weight is), zero point 0.
    """

    input_quant: Optional[FakeQuantizer]
    weight_quant: Optional[FakeQuantizer]
    output_quant: Optional[FakeQuantizer]
    #: axis of the weight that indexes output channels (per-channel scales), and the reduction axis
    weight_channel_axis = 0
    weight_reduction_axis = 1

    def _init_qat(self, spec, name: str = "", activation=None) -> None:
        self.qat_name = name
        self.activation = activation
        self.bias_mode = "int32"
        w_spec = getattr(spec, "weight", None)
        group = getattr(w_spec, "granularity", None) == "per_group"
        axis = self.weight_reduction_axis if group else self.weight_channel_axis
        if group and hasattr(self, "weight"):
            size = int(getattr(w_spec, "group_size", 0) or 0)
            ax = w_spec.axis if w_spec.axis is not None else axis
            if size <= 0 or self.weight.shape[ax] % size:
                # Groups that do not tile the reduction axis: per-channel is the closest valid choice.
                self.group_fallback = f"group size {size} does not divide {self.weight.shape[ax]}: per_channel used"
                w_spec = _per_channel_copy(w_spec)
                axis = self.weight_channel_axis
        self.input_quant = make_quantizer(getattr(spec, "input", None), None, f"{name}.input_quant")
        self.weight_quant = make_quantizer(w_spec, axis, f"{name}.weight_quant") if hasattr(self, "weight") else None
        self.output_quant = make_quantizer(getattr(spec, "output", None), None, f"{name}.output_quant")

    def quantized_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the matrix engine sees it: masked (2:4), then fake-quantized."""
        mask = getattr(self, "weight_mask", None)
        if mask is not None:
            weight = weight * mask.to(weight.dtype)
        return self.weight_quant(weight) if self.weight_quant is not None else weight

    def bias_scale(self) -> Optional[torch.Tensor]:
        """float32(s_in) * float32(s_w) when both are active integer quantizers, else None."""
        if self.bias_mode != "int32" or not (_active_integer(self.input_quant) and _active_integer(self.weight_quant)):
            return None
        if self.weight_quant.granularity.block_size:
            return None  # per-group weights: no single scale per output channel; bias stays float
        s_in = self.input_quant.scale.detach().float().reshape(())
        return (s_in * self.weight_quant.scale.detach().float()).reshape(-1)

    def quantized_bias(self, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if bias is None:
            return None
        scale = self.bias_scale()
        if scale is None:
            return bias
        if scale.numel() == 1:
            scale = scale.reshape(())
            return fake_quantize(bias, INT32, scale, None, check=False)
        from ..formats import Granularity

        return fake_quantize(bias, INT32, scale, None, Granularity(axis=0), check=False)

    def quantizers(self) -> dict[str, FakeQuantizer]:
        return {k: q for k in ("input_quant", "weight_quant", "output_quant")
                if (q := getattr(self, k, None)) is not None}

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        y = apply_activation(y, self.activation)
        return self.output_quant(y) if self.output_quant is not None else y

    def qat_extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        return f"bias_mode={self.bias_mode}{act}"
