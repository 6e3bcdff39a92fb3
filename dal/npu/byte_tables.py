"""A 256-entry float32 table looked up by 8-bit codes, in C++ for large tensors.

    y = T[byte of c]        (c int8 / uint8 codes of any shape, T float32 [256])

``np.take(T, c)`` converts the 1-byte indices to 8-byte ones first (a pass and an allocation
as large as eight times the codes); csrc/lut16.cpp ``lut8`` reads each byte and copies its table
entry, so both give the table's entries themselves, bit for bit (NaN payloads included). Used by
the scalar DequantizeLinear (quant_step.DequantStep) and the requantized moves
(code_moves.CodeMoves); bench/results/llm_npu.md has the timings. Below :data:`LARGE`
elements, without a build, or for a table that is not float32 [256], the numpy lookup runs.
"""
from __future__ import annotations

import numpy as np

#: from this many elements on the C++ lookup runs (below, the call's own cost is np.take's)
LARGE = 4096


class ByteTable:
    """``lookup(c)`` = ``T[c.view(uint8)]`` as float32 (module doc); ``table`` the 256 entries."""

    def __init__(self, table: np.ndarray):
        self.table = np.asarray(table)
        self._kernel = None  # (lut8, torch tensor of the table), looked up on the first large call
        self._usable = self.table.dtype == np.float32 and self.table.shape == (256,)

    def _lut8(self):
        from .build import BuildError, kernels
        try:
            import torch
            self._kernel = (kernels().lut8, torch.from_numpy, torch.from_numpy(np.ascontiguousarray(self.table)))
        except BuildError:
            self._usable = False
        return self._kernel

    def lookup(self, codes: np.ndarray) -> np.ndarray:
        """The table's entries at ``codes`` (a uint8 view of 1-byte codes, any shape and strides)."""
        if self._usable and codes.size >= LARGE and (self._kernel is not None or self._lut8() is not None):
            lut8, from_numpy, t = self._kernel
            return lut8(from_numpy(np.ascontiguousarray(codes)), t).numpy()
        return np.asarray(np.take(self.table, codes))
