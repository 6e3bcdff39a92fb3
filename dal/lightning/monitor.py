"""Model-wide quantization state as a few numbers, for a logger."""
from __future__ import annotations

from torch import nn

from ..nn.base import QATModule
from ..prepare.state import quantizers


def quant_state_metrics(model: nn.Module) -> dict:
    """``{"dal/quantizers_frozen": f, "dal/quantizers_active": f, "dal/bn_frozen": f,
    "dal/weight_sparsity": f}``: fractions of quantizers frozen, of quantizers quantizing at all
    (quantize or frozen), of fused Conv+BN with frozen statistics, and of QAT-layer weights
    removed by 2:4 masks (0 without sparsity)."""
    qs = [q for _, q in quantizers(model)]
    frozen = sum(q.state == "frozen" for q in qs)
    active = sum(q.state in ("quantize", "frozen") for q in qs)
    bns = [m for m in model.modules() if hasattr(m, "bn_frozen")]
    bn_frozen = sum(bool(m.bn_frozen) for m in bns)
    total = pruned = 0
    for m in model.modules():
        if isinstance(m, QATModule) and getattr(m, "weight", None) is not None:
            total += m.weight.numel()
            mask = getattr(m, "weight_mask", None)
            if mask is not None:
                pruned += int((~mask.bool()).sum())
    return {
        "dal/quantizers_frozen": frozen / max(len(qs), 1),
        "dal/quantizers_active": active / max(len(qs), 1),
        "dal/bn_frozen": bn_frozen / max(len(bns), 1),
        "dal/weight_sparsity": pruned / max(total, 1),
    }
