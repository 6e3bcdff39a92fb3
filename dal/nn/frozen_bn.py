"""A frozen BatchNorm recognised by what it computes, not by its class name.

torchvision's ``FrozenBatchNorm2d`` (its detectors' pretrained backbones), timm's, and Hugging Face's
copies (``DeformableDetrFrozenBatchNorm2d``, RT-DETR's, DETR's, ...) are one module under many
names: no parameters, four buffers of shape ``[C]``, and a forward computing, per channel ``c``,

    scale = weight / sqrt(running_var + eps)
    y     = x * scale + (bias - running_mean * scale)

``dal.prepare`` folds such a module into the conv before it exactly as an eval-mode BatchNorm2d
with frozen statistics (``dal.nn.conv_frozen_bn``). What qualifies is decided here, in two steps:

* structure: no parameters, no submodules, buffers ``weight``, ``bias``, ``running_mean`` and
  ``running_var``, each a 1-D floating tensor of one length ``C`` >= 1, dtype and device, finite;
* computation: the module's forward, run once on a copy of the module (its side effects do not
  reach the model) on a fixed probe ``x`` of shape ``[2, C, 3, 3]`` (signed values over a few
  orders of magnitude), equals the float64 formula above within ``8`` units of roundoff of the
  buffers' dtype per element, relative to ``|x * scale| + |bias| + |running_mean * scale|``,
  and leaves the four buffers as they were (a forward that updates its statistics is not frozen).

``eps`` is the module's ``eps`` attribute when it has a number there (torchvision, timm), else the
first of :data:`EPS_CANDIDATES` the probe confirms (Hugging Face's copies write ``1e-5`` inside
forward). A look-alike with the same buffers and another forward (no normalisation, an activation
inside, another eps) fails the probe and is left as the module it is.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from .tree import own_slots

BUFFERS = ("weight", "bias", "running_mean", "running_var")
#: eps values tried, in this order, for a module without an ``eps`` attribute
EPS_CANDIDATES = (1e-5, 1e-3, 1e-4, 0.0)
#: the probe's tolerance, in units of roundoff of the buffers' dtype (see the module doc)
PROBE_ULPS = 8.0


def frozen_batchnorm_eps(m: nn.Module) -> Optional[float]:
    """The ``eps`` with which ``m`` computes a frozen BatchNorm (module doc), or None when ``m`` is
    not one (wrong structure, or its forward computes something else on the probe).

    Example:
        >>> import torchvision
        >>> frozen_batchnorm_eps(torchvision.ops.FrozenBatchNorm2d(4, eps=1e-3))
        0.001
        >>> frozen_batchnorm_eps(nn.BatchNorm2d(4)) is None   # parameters: a trainable BN
        True
    """
    if not _frozen_structure(m):
        return None
    own = getattr(m, "eps", None)
    candidates = [float(own)] if isinstance(own, (int, float)) and not isinstance(own, bool) else []
    candidates += [e for e in EPS_CANDIDATES if e not in candidates]
    probe = _probe_output(m)
    if probe is None:
        return None
    x, y = probe
    for eps in candidates:
        if _matches_formula(m, x, y, eps):
            return eps
    return None


def is_frozen_batchnorm(m: nn.Module) -> bool:
    """Whether ``m`` computes a frozen BatchNorm (:func:`frozen_batchnorm_eps` is not None)."""
    return frozen_batchnorm_eps(m) is not None


def _frozen_structure(m) -> bool:
    if not isinstance(m, nn.Module) or next(m.parameters(), None) is not None or next(m.children(), None) is not None:
        return False
    bufs = [own_slots(m).buffers.get(name) for name in BUFFERS]
    if any(not isinstance(b, torch.Tensor) for b in bufs):
        return False
    first = bufs[0]
    if not first.is_floating_point() or first.dim() != 1 or first.numel() == 0 or first.is_meta:
        return False
    same = all(b.dim() == 1 and b.numel() == first.numel() and b.dtype == first.dtype and b.device == first.device
               for b in bufs)
    return same and all(bool(torch.isfinite(b).all()) for b in bufs)


def _probe_input(c: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c, 3, 3, generator=g, dtype=torch.float64)
    x = x * torch.logspace(-2, 2, 9, dtype=torch.float64).reshape(1, 1, 3, 3)  # signed, 1e-2 .. 1e2
    return x.to(dtype=dtype, device=device)


def _probe_output(m: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, forward(x))`` on a copy of ``m``, or None when the forward fails, returns no
    tensor of ``x``'s shape, or changes one of the four buffers."""
    w = m.get_buffer("weight")
    x = _probe_input(w.numel(), w.dtype, w.device)
    try:
        twin = copy.deepcopy(m)
        with torch.no_grad():
            y = twin.forward(x.clone())
    except Exception:  # noqa: BLE001 - any failure means "not a frozen BatchNorm"
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
        return None
    if any(not torch.equal(twin.get_buffer(n), m.get_buffer(n)) for n in BUFFERS):
        return None  # its forward moves its own statistics: not frozen
    return x, y


def _matches_formula(m: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float) -> bool:
    """``y`` equals the float64 frozen-BN formula of ``m``'s buffers on ``x`` within the probe's tolerance."""
    w, b, rm, rv = (m.get_buffer(n).detach().to("cpu", torch.float64).reshape(1, -1, 1, 1) for n in BUFFERS)
    var = rv + eps
    if not bool((var > 0).all()):
        return False
    scale = w / torch.sqrt(var)
    shift = b - rm * scale
    x64 = x.detach().to("cpu", torch.float64)
    want = x64 * scale + shift
    u = torch.finfo(m.get_buffer("weight").dtype).eps
    bound = PROBE_ULPS * u * ((x64 * scale).abs() + b.abs() + (rm * scale).abs()) + torch.finfo(torch.float64).tiny
    return bool(((y.detach().to("cpu", torch.float64) - want).abs() <= bound).all())
