"""Rule ``upsample_nearest``: interpolation modes the hardware's resize cannot run -> one it can.

``nn.Upsample`` / ``nn.UpsamplingBilinear2d`` with a mode missing from the hardware's
``resize_modes`` become ``nn.Upsample`` with ``nearest`` (or the first listed mode); exported
as ONNX ``Resize`` with that mode. Unlike the other rules this changes the function on purpose;
the report's cosine says by how much. Functional ``F.interpolate`` calls are not rewritten.
"""
from __future__ import annotations

from torch import nn

from .registry import rule

_LINEAR_MODES = ("linear", "bilinear", "bicubic", "trilinear")


def _mode(module) -> str:
    return "bilinear" if isinstance(module, nn.UpsamplingBilinear2d) else module.mode


def _target(hardware) -> str:
    modes = tuple(getattr(hardware, "resize_modes", ()) or ())
    return "nearest" if not modes or "nearest" in modes else modes[0]


@rule("upsample_nearest")
class UpsampleNearestRule:
    """Upsample modules whose mode the hardware lacks -> nn.Upsample(mode='nearest')."""

    def match(self, module, name, hardware=None) -> bool:
        if not isinstance(module, nn.Upsample) or _mode(module) not in _LINEAR_MODES:
            return False
        return hardware is None or _mode(module) not in (hardware.resize_modes or ())

    def build(self, module, hardware):
        mode = _target(hardware)
        new = nn.Upsample(size=module.size, scale_factor=module.scale_factor, mode=mode,
                          align_corners=None if mode == "nearest" else module.align_corners)
        new.train(module.training)
        return new

    def describe(self, module, name) -> str:
        return f"mode {_mode(module)} -> nearest (changes the function; see cosine)"

    def why_nothing(self, hardware):
        if hardware is not None:
            return f"hardware {hardware.name} resizes with {list(hardware.resize_modes)}; no Upsample needs changing"
        return "no bilinear/bicubic/linear nn.Upsample module"
