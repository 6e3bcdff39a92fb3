"""``F.grid_sample`` trained as the NPU runs it (export/SPEC.md §5b): the input quantized by the
recipe's input spec, the sampling grid in int16 with a fixed scale, the output on the input's
own scale and zero point (no output observer).

    y = Q_x(grid_sample(Q_x(x), Q_g(grid), mode, padding_mode, align_corners))

``Q_x`` is the input quantizer (its scale and zero point are the output's too: the output's
fake quantization uses the input quantizer's current scale, and the exported file has a second
Q/DQ pair of the same quantizer after the GridSample). ``Q_g`` is :class:`GridQuantizer`: int16,
symmetric, scale ``2^-GRID_SCALE_LOG2`` fixed at construction and never observed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..formats import fake_quantize
from ..quantizer import FakeQuantizer, QState
from .base import QATModule
from .spec import make_quantizer, role_specs

#: the grid's scale is ``2^-GRID_SCALE_LOG2``: int16 codes cover [-2, 2) in normalized coordinates
GRID_SCALE_LOG2 = 14
MODES = ("bilinear", "nearest")
PADDING_MODES = ("zeros", "border")
#: torch.grid_sampler's integer enums (torch.nn.functional.GRID_SAMPLE_*_MODES)
_MODE_OF_ENUM = {0: "bilinear", 1: "nearest", 2: "bicubic"}
_PADDING_OF_ENUM = {0: "zeros", 1: "border", 2: "reflection"}


def grid_scale(height: int, width: int) -> float:
    """The grid quantizer's scale for an input of ``height`` x ``width`` pixels: ``2^-14`` on both
    axes, the finest power of two whose int16 range ``[-2, 2)`` holds every normalized coordinate
    that can still reach a pixel of an axis of ``n >= 2`` pixels (``n >= 4`` with
    ``align_corners``; export/SPEC.md §5b). One LSB is at most ``n * 2^-15`` pixel along that axis:
    ValueError when that exceeds 1/4 pixel (``n > 8192``).

    >>> grid_scale(64, 64)
    6.103515625e-05
    """
    for n, axis in ((height, "height"), (width, "width")):
        if n > 8192:
            raise ValueError(f"grid_sample input {axis} {n} > 8192: one int16 grid LSB (2^-14) would be more than "
                             "1/4 pixel")
    return 2.0 ** -GRID_SCALE_LOG2


class GridQuantizer(FakeQuantizer):
    """int16, symmetric, per tensor, scale ``2^-14`` and zero point 0 from the start, in state
    ``frozen``: calibration leaves it alone (it quantizes the grid while the other quantizers
    observe) and QAT never moves it; put in ``observe`` / ``quantize`` by hand, it still takes
    the fixed values (``compute_qparams``) and tracks no range."""

    def __init__(self, name: str = ""):
        super().__init__("int16", symmetric=True, observer="minmax", name=name)
        self.set_qparams(torch.tensor(2.0 ** -GRID_SCALE_LOG2), torch.tensor(0, dtype=torch.int32))
        self.set_state(QState.FROZEN)

    @torch.no_grad()
    def compute_qparams(self) -> None:
        self.set_qparams(torch.tensor(2.0 ** -GRID_SCALE_LOG2, device=self.scale.device),
                         torch.tensor(0, dtype=torch.int32, device=self.scale.device))

    def tracking(self) -> bool:
        """Never: the grid scale is fixed (2^-GRID_SCALE_LOG2), no QAT step moves it."""
        return False


def grid_sample_args(args: tuple, kwargs: dict, torch_enum: bool = False) -> tuple[str, str, bool]:
    """``(mode, padding_mode, align_corners)`` of a call of ``F.grid_sample(input, grid, mode,
    padding_mode, align_corners)`` or, with ``torch_enum``, of ``torch.grid_sampler(input, grid,
    interpolation_mode, padding_mode, align_corners)`` (integer enums)."""
    names = ("mode", "padding_mode", "align_corners")
    vals = [args[2 + i] if len(args) > 2 + i else kwargs.get(k) for i, k in enumerate(names)]
    if torch_enum:
        vals[0] = _MODE_OF_ENUM.get(vals[0], vals[0])
        vals[1] = _PADDING_OF_ENUM.get(vals[1], vals[1])
    mode = "bilinear" if vals[0] is None else vals[0]
    padding = "zeros" if vals[1] is None else vals[1]
    return str(mode), str(padding), bool(vals[2]) if vals[2] is not None else False


def check_grid(path: str, x: torch.Tensor, grid: torch.Tensor) -> None:
    """ValueError naming ``path`` unless ``x`` is (N, C, H, W) and ``grid`` (N, H_out, W_out, 2)."""
    if x.dim() != 4:
        raise ValueError(f"{path or 'grid_sample'}: input must be 4-D (N, C, H, W), got shape {list(x.shape)}")
    if grid.dim() != 4 or grid.shape[-1] != 2 or grid.shape[0] != x.shape[0]:
        raise ValueError(f"{path or 'grid_sample'}: grid must be (N, H_out, W_out, 2) with N = {x.shape[0]} (the "
                         f"input's batch), got shape {list(grid.shape)}")
    if not grid.is_floating_point():
        raise ValueError(f"{path or 'grid_sample'}: grid must be a float tensor, got {grid.dtype}")


class SharedRequant(torch.nn.Module):
    """The output requantization of a layer whose output has its input's scale and zero point (no
    output observer): ``forward(y, q) = fake_quantize(y, q.fmt, s, zp)`` with the quantizer ``q``'s
    current (effective) scale and zero point, ``q`` the owner's sibling quantizer named
    ``shares_calls_of``. It never observes and holds no state (the state_dict is unchanged). A
    module so that dal.verify can hook it: its calls are that quantizer's further calls in the
    exported file (``<owner>.<shares_calls_of>/QuantizeLinear_1``, ...), in call order."""

    def __init__(self, shares_calls_of: str):
        super().__init__()
        self.shares_calls_of = shares_calls_of

    def forward(self, y: torch.Tensor, q: FakeQuantizer) -> torch.Tensor:
        scale, zero_point = q.effective_qparams()
        return fake_quantize(y, q.fmt, scale, zero_point, q.granularity, q.narrow_range, check=False)

    def extra_repr(self) -> str:
        return f"shares_calls_of={self.shares_calls_of!r}"


class QGridSample(QATModule):
    """``F.grid_sample`` with an int8 / uint8 input, an int16 grid and the input's scale on the
    output (module doc). ``mode`` bilinear or nearest, ``padding_mode`` zeros or border, both
    ``align_corners``. Called as ``module(x, grid)``; x (N, C, H, W), grid (N, H_out, W_out, 2)
    (another shape: ValueError naming the module's path)."""

    op_class = "grid_sample"
    swappable = False

    def __init__(self, spec=None, name: str = "", mode: str = "bilinear", padding_mode: str = "zeros",
                 align_corners: bool = False):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"{name or 'QGridSample'}: grid_sample mode {mode!r} is not supported (one of {MODES})")
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"{name or 'QGridSample'}: grid_sample padding_mode {padding_mode!r} is not supported "
                             f"(one of {PADDING_MODES})")
        self.qat_name = name
        self.mode, self.padding_mode, self.align_corners = mode, padding_mode, bool(align_corners)
        in_spec, _, _ = role_specs(spec)
        self.input_quant = make_quantizer(in_spec, None, f"{name}.input_quant", force_per_tensor=True)
        self.grid_quant = GridQuantizer(f"{name}.grid_quant")
        self.output_requant = SharedRequant("input_quant")  # the output on the input's scale (module doc)

    @classmethod
    def from_spec(cls, spec=None, name: str = "", **kwargs):
        return cls(spec, name, **kwargs)

    def quantizers(self) -> dict:
        found = {"grid_quant": self.grid_quant}
        if self.input_quant is not None:
            found["input_quant"] = self.input_quant
        return found

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        q: Optional[FakeQuantizer] = self.input_quant
        if q is None or not q.state.quantizes:
            return y
        if torch.onnx.is_in_onnx_export() or not q.fmt.is_scaled:
            return q(y)  # the exporter's placeholder (Q/DQ with the input's scale), or an FP16 cast: no observer
        return self.output_requant(y, q)

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        check_grid(self.qat_name, x, grid)
        grid_scale(x.shape[2], x.shape[3])
        xq = self.input_quant(x) if self.input_quant is not None else x
        y = F.grid_sample(xq, self.grid_quant(grid), mode=self.mode, padding_mode=self.padding_mode,
                          align_corners=self.align_corners)
        return self._output(y)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, padding_mode={self.padding_mode!r}, align_corners={self.align_corners}"
