"""The report's histograms: weights and activations of each layer, with each quantizer's clipping range.

Clipping range of a quantizer with scale ``s`` and zero point ``z``: integers
``[s (q_min - z), s (q_max - z)]``; FP8 ``[-s m, s m]`` with ``m`` the format's largest finite value.
Per channel (or group) the widest range is drawn solid and the median one's dashed, and
``clipped`` is exact: the fraction of elements outside their own channel's (group's) range.

Histograms are counted with ``torch.histc`` where the tensor is (80 bins over the finite values'
range), so an activation is reduced to its counts inside the forward hook and never kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..calibration.batches import run_model
from ..prepare.state import quantizers
from .common import ACTIVE

BINS = 80


@dataclass
class Panel:
    """One histogram: ``counts`` over ``edges``, the quantizer's clipping ``ranges`` as
    (lo, hi, linestyle), ``clipped``: fraction of the ``elements`` outside the range."""

    layer: str
    title: str         # what the tensor is, with its format: "weight (int4, per channel)"
    fmt: str           # the format alone: "int4, per channel"
    counts: np.ndarray
    edges: np.ndarray
    ranges: list
    clipped: float
    elements: int
    nonfinite: int = 0


def clip_range(q) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per scale element of a calibrated scaled quantizer (see the module docstring)."""
    s, z = q.effective_qparams()
    s = s.float()
    if q.fmt.is_float8:
        return -s * q.fmt.max_value, s * q.fmt.max_value
    z = z.float()  # a learnable zero point rounded, as the forward rounds it
    return s * (q.qmin - z), s * (q.qmax - z)


def _ranges(lo: torch.Tensor, hi: torch.Tensor) -> list:
    if lo.numel() == 1:
        return [(float(lo), float(hi), "-")]
    width = (hi - lo).flatten()
    mid = int(width.argsort()[len(width) // 2])
    return [(float(lo.min()), float(hi.max()), "-"), (float(lo.flatten()[mid]), float(hi.flatten()[mid]), "--")]


def _granularity_label(q) -> str:
    kind = q.granularity.kind
    return "" if kind == "per_tensor" else ", " + kind.replace("_", " ")


def panel(layer: str, title: str, x: torch.Tensor, q) -> Panel:
    """The histogram of ``x`` (the tensor ``q`` quantizes) with ``q``'s clipping range."""
    x = x.detach()
    if not x.is_floating_point() or x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    lo, hi = clip_range(q)
    try:
        clipped = float(((x < q.granularity.expand(lo, x.shape)) | (x > q.granularity.expand(hi, x.shape)))
                        .sum()) / max(x.numel(), 1)
    except (RuntimeError, ValueError):  # a scale that does not broadcast to this tensor
        clipped = float("nan")
    flat = x.flatten()
    finite = torch.isfinite(flat)
    nonfinite = int(flat.numel() - int(finite.sum()))
    if nonfinite:
        flat = flat[finite]
    if flat.numel():
        a, b = float(flat.min()), float(flat.max())
    else:
        a = b = 0.0
    if not b > a:  # constant tensor: one visible bin around the value
        half = max(abs(a) * 1e-3, 1e-6)
        a, b = a - half, b + half
    counts = torch.histc(flat.float(), bins=BINS, min=a, max=b) if flat.numel() else torch.zeros(BINS)
    edges = np.linspace(a, b, BINS + 1)
    fmt = f"{q.fmt.name}{_granularity_label(q)}"
    return Panel(layer, f"{title} ({fmt})", fmt, counts.numpy().astype(np.int64), edges, _ranges(lo, hi), clipped,
                 int(x.numel()), nonfinite)


def _scaled(q) -> bool:
    return q is not None and q.fmt.is_scaled and q.initialized


def weight_panels(layers) -> dict:
    """``{layer path: Panel}`` of each layer's weight as its quantizer sees it (Conv+BN folded)."""
    out = {}
    for name, mod in layers:
        q = getattr(mod, "weight_quant", None)
        if not _scaled(q) or q.state not in ACTIVE:
            continue
        w = mod.folded_weight_and_bias()[0] if hasattr(mod, "folded_weight_and_bias") else mod.weight
        out[name] = panel(name, "weight", w, q)
    return out


def owner(qname: str, layer_names: list) -> str:
    """The layer path a quantizer belongs to: the longest layer path that prefixes it ("" if none)."""
    best = ""
    for name in layer_names:
        if (qname == name or qname.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


def activation_panels(model, args, kwargs, layer_names: list) -> dict:
    """``{layer path: [Panel, ...]}``: the tensor entering each active activation quantizer on one
    batch (its first call), grouped by the layer the quantizer belongs to ("" for none)."""
    seen: dict = {}
    hooks = []

    def keep(name, q, x):
        if name not in seen and torch.is_tensor(x):
            where = owner(name, layer_names)
            label = name[len(where) + 1:] if where else name
            seen[name] = panel(where, label, x, q)
        return None  # a pre-hook's return value would replace the input

    for name, q in quantizers(model):
        if _scaled(q) and q.state in ACTIVE and not name.endswith("weight_quant"):
            hooks.append(q.register_forward_pre_hook(lambda m, a, name=name: keep(name, m, a[0] if a else None)))
    try:
        run_model(model, args, kwargs)
    finally:
        for h in hooks:
            h.remove()
    grouped: dict = {}
    for p in seen.values():  # first-call order: execution order
        grouped.setdefault(p.layer, []).append(p)
    return grouped


def worst_first(layer_names: list, rows: Optional[list]) -> list:
    """Layer paths ordered by per-layer output cosine vs float, lowest first; layers without a
    measurement keep their order, after the measured ones."""
    if not rows:
        return list(layer_names)
    cos = {r["layer"]: r["cosine"] for r in rows}
    measured = sorted((n for n in layer_names if n in cos), key=lambda n: cos[n])
    return measured + [n for n in layer_names if n not in cos]
