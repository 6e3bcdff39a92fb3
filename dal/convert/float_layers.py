"""A float ``nn.Linear`` / ``nn.Conv1d|2d|3d`` in the integer model: what its exported float
Gemm / MatMul / Conv computes on the NPU (export/SPEC.md §5a, float islands), not torch's
float32 kernel.

A layer left float on purpose (a recipe rule with ``skip: true``, a layer that never ran at
prepare) is exported with its float32 weight and bias, and the NPU computes it as every float
island's matrix product: the products and the whole sum in float64, rounded once to float32,
then the bias in one float32 addition,

    s = float32(sum_k float64(x[k]) * float64(W[o, k]))        y = s + b[o]   (float32)

torch's float32 conv / matmul sums in float32 in its own blocked order, so left as it was the
integer model differed from dal.npu there on most elements of the layer (seen on a skipped
classifier and on a skipped 1x1 detection head conv: 2901 of 4116 output values).
The float64 sum is not exact for every input either (float32 products are exact in float64, a
long sum of them need not be), so an element whose float64 sums, in the two engines' orders,
straddle a float32 rounding boundary may still differ: the residual near-tie of §5a.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
import torch.nn.functional as F

from .errors import ConvertError
from .op_forms import Derived, per_registry
from .wrapped import float_attribute
from ..nn.tree import own_slots

@per_registry
def _float_layer_types(ops) -> tuple:
    """The registered ops' module types that compute ``F.linear`` (an ``nn.Linear``, a lazy one
    excepted: it has no weight until it runs) or define their own ``_conv_forward`` (a ConvNd; a
    transposed conv inherits _ConvNd's placeholder)."""
    return tuple(t for op in ops for t in op.modules
                 if (issubclass(t, nn.Linear) and not issubclass(t, LazyModuleMixin)) or _own_conv_forward(t))


def _own_conv_forward(t: type) -> bool:
    """Whether class ``t`` defines ``_conv_forward`` itself (not inherited)."""
    f = getattr(t, "_conv_forward", None)
    return f is not None and getattr(f, "__qualname__", "") == f"{t.__qualname__}._conv_forward"


#: the float layers that have this form: exactly these classes (a QAT subclass is an integer
#: layer): nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, read from dal.ops (op_forms.py)
FLOAT_LAYER_TYPES = Derived(_float_layer_types)


def is_float_layer(mod: nn.Module) -> bool:
    """A plain float32 ``nn.Linear`` / ``nn.ConvNd`` (not a subclass: QAT layers subclass them)."""
    return type(mod) in FLOAT_LAYER_TYPES and mod.weight.dtype == torch.float32 \
        and (mod.bias is None or mod.bias.dtype == torch.float32)


class FloatLayerForm(nn.Module):
    """``mod`` computed as the NPU's float island (module doc); the module is kept as ``layer``
    (its parameters, its state_dict keys under ``layer.``). A non-float32 input runs ``mod`` itself."""

    def __init__(self, mod: nn.Module, path: str):
        super().__init__()
        self.layer = mod
        self.path = path

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules ("layer")
        except AttributeError:
            if name not in own_slots(self.layer).parameters:
                found, value = float_attribute(self.layer, name)  # stride, in_features, ... (wrapped.py)
                if not found:
                    raise
                return value
        # a parent that reads the layer's weight and computes with it itself (torchvision's
        # ShiftedWindowAttention: F.linear(x, self.qkv.weight, ...)) never calls this form, so the
        # integer model could not compute what the NPU's float island does: say so, by path
        raise ConvertError(f"{self.path}: its parent reads its {name!r} and computes the layer itself "
                           f"instead of calling it, so dal.convert cannot compute it as the NPU does (a float "
                           f"{type(self.layer).__name__} island, export/SPEC.md §5a). Give the parent a QAT module "
                           f"(@dal.register_qat_module) or a recipe replace rule that swaps it (replace: [npu_attention] for "
                           f"attention)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mod = self.layer
        if x.dtype != torch.float32:
            return mod(x)
        w = mod.weight.double()
        if isinstance(mod, nn.Linear):
            s = F.linear(x.double(), w).float()
            return s if mod.bias is None else s + mod.bias
        # _conv_forward applies the padding mode (reflect / replicate / circular pad first)
        s = mod._conv_forward(x.double(), w, None).float()
        if mod.bias is None:
            return s
        return s + mod.bias.reshape(1, -1, *[1] * (s.dim() - 2))
