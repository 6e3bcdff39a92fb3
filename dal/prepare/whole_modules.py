"""Modules prepare plans whole, by what they compute, instead of reading their forward.

A library's RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``) or formula activation
(transformers' ``NewGELUActivation``: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``)
is one operator of the chip, but its forward is several torch calls: read call by call, each
``*`` and ``+`` would get its own quantizer and the ``tanh`` / ``rsqrt`` would be a float op of
their own. :func:`planned_whole` recognises them by running them (``dal.replace.rmsnorm``,
``dal.replace.activation_probe``) and gives the :class:`FloatOp` the whole module is planned as,
which the hardware check then decides like any float module (an FP16 island, a lookup table
through ``lut_activation``, or a refusal by path).

An activation written as a single torch call (timm's ``GELU`` calling ``F.gelu``) is read as
before: its one call is already that operator.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from ..replace.activation_probe import candidate, function_calls, probe_activation
from ..replace.rmsnorm import rmsnorm_eps
from .float_ops import FloatOp


def planned_whole(mod: nn.Module) -> Optional[FloatOp]:
    """The FloatOp ``mod`` is planned as whole (an RMSNorm: ``layernorm`` / ``rmsnorm``; an
    activation computed by a formula of several torch calls: ``activation`` / its function), or
    None: plan it as before."""
    if rmsnorm_eps(mod) is not None:
        return FloatOp("float", "layernorm", "rmsnorm")
    if not candidate(mod):
        return None
    found = probe_activation(mod)
    if found is None or len(function_calls(mod)) < 2:
        return None
    return FloatOp("float", "activation", found[0])
