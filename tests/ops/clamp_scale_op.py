import torch
from torch import nn

import dal


class ClampScale(nn.Module):
    """The float op: y = clamp(x, lo, hi) * s."""

    def __init__(self, lo=-1.0, hi=1.0, s=0.5):
        super().__init__()
        self.lo, self.hi, self.s = lo, hi, s

    def forward(self, x):
        return torch.clamp(x, self.lo, self.hi) * self.s


@dal.ops.register(ClampScale, op_class="activation", onnx=("Clip", "Mul"), cost="vector")
class QClampScale(dal.nn.QATModule, ClampScale):
    """Its QAT form: the recipe's input and output quantizers around the float op
    (exported as Q -> DQ -> Clip -> Mul -> Q -> DQ)."""

    def forward(self, x):
        x = self.input_quant(x) if self.input_quant is not None else x
        return self.finish(torch.clamp(x, self.lo, self.hi) * self.s)
