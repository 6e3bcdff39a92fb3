"""The weight quantizer of a linear layer seen one input column at a time, for the second-order
PTQ algorithms (GPTQ, SparseGPT) that quantize a weight column by column.

A QLinear's weight ``W`` (``out x in``) is quantized per tensor, per output channel (axis 0) or
per group of ``g`` consecutive input columns (axis 1, one scale per row and group). Column ``j``
of ``W`` then has one ``(scale, zero_point)`` per row:

    code = clamp(round_half_even(w / s) + z, qmin, qmax)        q = (code - z) * s

(ONNX QuantizeLinear, the formula of ``dal.formats.fake_quantize``). Per tensor and per channel
the scales are the quantizer's calibrated ones. Per group, a group's scales are chosen when the
column loop reaches the group's first column, by the quantizer's own observer rule (a fresh copy
of its observer, same class and arguments) over the group's *current* weights, as GPTQ does
(``refresh``); or all at once from the weights as given (``static_groups``).

Several layers with one input (q / k / v) and one quantizer configuration are stacked by rows
into one grid: rows are independent, so one column loop serves them all.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import per_group
from ..quantizer import FakeQuantizer


def grid_key(wq: FakeQuantizer) -> tuple:
    """Weight quantizers with equal keys can share one stacked grid (same format, granularity,
    rounding rule and observer rule)."""
    obs = wq.observer
    return (wq.fmt.name, str(wq.granularity), wq.symmetric, wq.narrow_range, wq.power_of_two,
            type(obs).__name__, getattr(obs, "fixed_scale", None), getattr(obs, "candidates", None))


def fresh_observer(wq: FakeQuantizer, group: int):
    """A copy of ``wq``'s observer (class and arguments) that has seen nothing, observing blocks of
    ``group`` columns along axis 1."""
    obs = wq.observer.fresh_copy()
    obs.granularity = per_group(1, group)
    return obs


class ColumnGrid:
    """Per-row ``(scale, zero_point)`` of every input column of a stack of linear weights.

    Args:
        quantizers: the weight quantizers of the stacked layers (equal ``grid_key``), calibrated.
        rows: the number of rows (output features) each contributes, in stacking order.
        columns: the number of input columns.
        dtype: the dtype of the column arithmetic (``w / s`` and ``(code - z) * s``).
    """

    def __init__(self, quantizers: list, rows: list, columns: int, dtype=torch.float32):
        wq = quantizers[0]
        self.quantizers, self.rows, self.columns, self.dtype = list(quantizers), list(rows), columns, dtype
        self.qmin, self.qmax = float(wq.qmin), float(wq.qmax)
        gran = wq.granularity
        axis = gran.normalized_axis(2)
        self.group = 0
        if gran.block_size:
            if axis != 1:
                raise ValueError(f"{wq.name}: per-group weight quantization along axis {gran.axis}; GPTQ needs the "
                                 "groups along the input columns (axis 1)")
            self.group = gran.block_size
        elif axis not in (None, 0):
            raise ValueError(f"{wq.name}: per-channel weight quantization along axis {gran.axis}; GPTQ needs "
                             "per-tensor, per-output-channel (axis 0) or per-group (axis 1) scales")
        total = sum(rows)
        ngroups = columns // self.group if self.group else 1
        self.scale = torch.empty(total, ngroups, dtype=torch.float32)
        self.zero_point = torch.empty(total, ngroups, dtype=torch.int32)
        r0 = 0
        for q, n in zip(self.quantizers, self.rows):
            s, z = q.effective_qparams()
            s = s.detach().float().cpu()
            z = z.detach().to(torch.int32).cpu()
            if self.group:
                self.scale[r0:r0 + n] = s.reshape(n, ngroups)
                self.zero_point[r0:r0 + n] = z.reshape(n, ngroups)
            else:
                self.scale[r0:r0 + n] = s.reshape(-1, 1).expand(n, 1) if s.numel() == n else s.reshape(1, 1)
                self.zero_point[r0:r0 + n] = z.reshape(-1, 1).expand(n, 1) if z.numel() == n else z.reshape(1, 1)
            r0 += n
        self._s = self._z = None
        self._current = -1

    def group_of(self, column: int) -> int:
        """Index of the scale column that serves input column ``column``."""
        return column // self.group if self.group else 0

    @torch.no_grad()
    def refresh(self, column: int, w: torch.Tensor) -> None:
        """Choose the scales of the group starting at ``column`` from ``w`` (rows x ``group``), the
        group's current weights, by the quantizer's observer rule. A no-op without groups."""
        if not self.group:
            return
        g = column // self.group
        r0 = 0
        for q, n in zip(self.quantizers, self.rows):
            obs = fresh_observer(q, self.group)
            obs(w[r0:r0 + n].float())
            s, z = obs.calculate_qparams()
            self.scale[r0:r0 + n, g] = s.reshape(n).float()
            self.zero_point[r0:r0 + n, g] = z.reshape(n).to(torch.int32)
            r0 += n
        if g == self._current:
            self._current = -1

    def static_groups(self, w: torch.Tensor) -> None:
        """Every group's scales from ``w`` (rows x columns) at once: GPTQ's static groups."""
        for c in range(0, self.columns, self.group or self.columns):
            self.refresh(c, w[:, c:c + self.group] if self.group else w)

    def _column_params(self, column: int) -> tuple:
        g = self.group_of(column)
        if g != self._current:
            self._s = self.scale[:, g].to(self.dtype)
            self._z = self.zero_point[:, g].to(self.dtype)
            self._zero = not bool(self._z.any())  # symmetric signed: skip the two zero-point ops
            self._current = g
        return self._s, self._z

    def quantize(self, w: torch.Tensor, column: int, out: Optional[torch.Tensor] = None) -> tuple:
        """``(q, code)`` of column ``column``'s weights ``w`` (one per row), in ``self.dtype``;
        the codes are written into ``out`` when given (the solver's code matrix row)."""
        s, z = self._column_params(column)
        code = torch.div(w, s, out=out).round_()
        if self._zero:
            return code.clamp_(self.qmin, self.qmax).mul(s), code
        code.add_(z).clamp_(self.qmin, self.qmax)
        return (code - z).mul_(s), code

    def split(self) -> list:
        """Per stacked layer: ``(scale, zero_point)`` shaped for its quantizer (``set_qparams``)."""
        out, r0 = [], 0
        for q, n in zip(self.quantizers, self.rows):
            s, z = self.scale[r0:r0 + n], self.zero_point[r0:r0 + n]
            if not self.group:
                s, z = q.effective_qparams()
                s, z = s.detach().float().cpu(), z.detach().cpu()
            out.append((s.clone(), z.clone()))
            r0 += n
        return out

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """``(code - z) * s`` in float32 for a full ``rows x columns`` code matrix (the weight to write)."""
        s = self.scale.repeat_interleave(self.group, dim=1) if self.group else self.scale
        z = self.zero_point.repeat_interleave(self.group, dim=1) if self.group else self.zero_point
        return (codes.float() - z.float()) * s
