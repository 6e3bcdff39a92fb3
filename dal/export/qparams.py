"""A quantizer's trained parameters as the numpy arrays that go into the ONNX file."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..formats import QFormat, quantize
from ..quantizer import FakeQuantizer


@dataclass
class QParams:
    """scale (float32) and zero point (typed like the format) shaped for QuantizeLinear.

    ``axis`` / ``block_size`` are the ONNX attributes: None / 0 for per tensor, ``axis`` for per
    channel (scale is 1-D), ``axis`` + ``block_size`` for blocks (scale has the input's rank).
    """

    fmt: QFormat
    scale: np.ndarray
    zero_point: np.ndarray
    axis: Optional[int]
    block_size: int
    narrow_range: bool

    def attrs(self) -> dict:
        a = {}
        if self.axis is not None:
            a["axis"] = int(self.axis)
        if self.block_size:
            a["block_size"] = int(self.block_size)
        return a

    def permuted(self, perm: tuple[int, ...]) -> "QParams":
        """The parameters of the same quantization applied to ``x.transpose(perm)``."""
        if self.axis is None:
            return self
        axis = perm.index(self.axis)
        if not self.block_size:
            return QParams(self.fmt, self.scale, self.zero_point, axis, 0, self.narrow_range)
        return QParams(self.fmt, self.scale.transpose(perm), self.zero_point.transpose(perm), axis,
                       self.block_size, self.narrow_range)


def qparams_of(q: FakeQuantizer, shape: tuple[int, ...]) -> QParams:
    """The parameters ``q`` applies to a tensor of ``shape`` (its trained scale, zero point)."""
    gran = q.granularity
    axis = gran.normalized_axis(len(shape))
    scale_shape = gran.scale_shape(shape)
    scale = q.scale.detach().float().cpu().reshape(scale_shape).numpy().astype(np.float32)
    if q.fmt.is_float8:
        zp = np.zeros(scale_shape, dtype=q.fmt.numpy_dtype())
    else:
        # A learnable zero point is a float Parameter; the forward pass rounds it (LSQ+).
        zp_t = q.effective_qparams()[1].cpu().reshape(scale_shape)
        zp = zp_t.numpy().astype(np.int64).astype(q.fmt.numpy_dtype())
    return QParams(q.fmt, scale, zp, axis, gran.block_size, q.narrow_range)


def quantize_constant(q: FakeQuantizer, value: np.ndarray) -> np.ndarray:
    """Codes of a constant tensor (a weight), typed for the ONNX file (int8, int4, float8, ...).

    Uses ``dal.formats.quantize`` - the same function the fake quantizer's forward divides and
    rounds with - so the stored codes are exactly what training saw; ``narrow_range`` is honoured
    here (a stored weight never holds the dropped code), unlike at activations.
    """
    t = torch.from_numpy(np.array(value, dtype=np.float32, copy=True))
    zp = q.effective_qparams()[1]
    threads = torch.get_num_threads()
    # A handful of memory-bound elementwise passes per weight: on 2 shared cores, syncing two
    # intra-op threads costs more than it saves (measured 3-5x slower on ResNet-18's weights).
    torch.set_num_threads(1)
    try:
        codes = quantize(t, q.fmt, q.scale.detach().float(), zp, q.granularity, q.narrow_range)
    finally:
        torch.set_num_threads(threads)
    if q.fmt.is_float8:
        return codes.view(torch.uint8).numpy().view(q.fmt.numpy_dtype())
    return codes.numpy().astype(q.fmt.numpy_dtype())
