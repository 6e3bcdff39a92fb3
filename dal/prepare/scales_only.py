"""Scale-only QAT (recipe key ``train: scales_only``): every weight, bias and BatchNorm statistic
is frozen; only the parameters of the (``learnable: true``) fake quantizers, their scales and
zero points, keep ``requires_grad``. An optimizer over ``model.parameters()`` then trains only
those (torch optimizers skip a parameter whose ``.grad`` stays None), so the user's loop is
unchanged and the weights stay exactly the float (or AdaRound) ones."""
from __future__ import annotations

from torch import nn

from ..quantizer import FakeQuantizer
from .state import freeze_bn


def freeze_all_but_quantizers(model: nn.Module) -> list[nn.Parameter]:
    """Set ``requires_grad=False`` on every parameter of ``model`` that no FakeQuantizer owns and
    freeze BN statistics (``freeze_bn``); returns the quantizer parameters that still train
    (scale Parameters created later by calibration, LSQ's ``log2_scale``, train as well)."""
    keep = {id(p) for m in model.modules() if isinstance(m, FakeQuantizer) for p in m.parameters(recurse=False)}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)
    freeze_bn(model)
    return [p for p in model.parameters() if id(p) in keep and p.requires_grad]
