"""``QScatterAdd`` in the integer model: the scatter-add integer group of export/SPEC.md §5c, on
integer codes in torch int64, what dal.npu computes from the file.

    acc = (d - z) + sum (u - z)          int64, exact; ConvertError naming the layer at |acc| >= 2^31
    v   = float32(float64(acc) * float64(s))
    y   = Q_y(v)                          round_half_even(v / s_y) + z_y, clamped (float32 division)

``d`` / ``u`` are the codes of the destination and the updates under the input quantizer (scale
``s``, zero point ``z``), ``Q_y`` the output quantizer. The QAT module sums the same integers in
float32 / float64 instead; this form takes the codes from ``dal.formats.quantize`` and never calls
the module's own arithmetic.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats import quantize
from ..nn.scatter_add import scatter_operands
from .errors import ConvertError
from .wrapped import WrapsModule


class ScatterAddForm(WrapsModule):
    """A ``QScatterAdd`` (``qat``) as the file computes it (module doc). Without active integer
    input and output quantizers (a float scatter): the QAT module itself."""

    def __init__(self, qat: nn.Module, path: str):
        super().__init__()
        self.qat, self.path = qat, path

    def forward(self, x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        m = self.qat
        qi, qo = m.input_quant, m.output_quant
        active = [q is not None and q.state.quantizes and q.fmt.is_integer for q in (qi, qo)]
        if not all(active) or not x.is_floating_point():
            return m(x, index, src)
        dim, idx, upd = scatter_operands(m.kind, x, index, src, m.dim, self.path, values=False)
        qi(upd), qi(x)  # the file's two QuantizeLinear of the input quantizer, in its order (codes taps)
        s, z = qi.effective_qparams()
        d_codes = quantize(x, qi.fmt, s, z, qi.granularity).to(torch.int64)
        u_codes = quantize(upd, qi.fmt, s, z, qi.granularity).to(torch.int64)
        zz = z.to(torch.int64).reshape(())
        acc = torch.scatter_add(d_codes - zz, dim, idx, u_codes - zz)
        if acc.numel() and (int(acc.min()) < -(1 << 31) or int(acc.max()) >= (1 << 31)):
            raise ConvertError(f"{self.path}: scatter-add accumulator [{int(acc.min())}, {int(acc.max())}] leaves "
                               "int32 (export/SPEC.md §5c)")
        v = (acc.to(torch.float64) * s.reshape(()).to(torch.float64)).to(torch.float32)
        return qo(v)  # the output QuantizeLinear (ONNX semantics: a frozen quantizer in the eval-mode copy)
