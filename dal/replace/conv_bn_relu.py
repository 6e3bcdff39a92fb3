"""Rule ``conv_bn_relu``: report the Conv2d -> BatchNorm2d (-> ReLU) chains the NPU runs fused.

A report-only rule: ``prepare_qat`` already fuses every such chain it finds in a module's own
forward into ``QConvBn2d`` / ``QConvBnReLU2d`` (BN folded into the weights, as the hardware
runs it), so this rule changes nothing; it lists the chains, so a model whose convolutions
would *not* fuse (a BN used twice, a conv output consumed elsewhere) shows up before training.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .registry import rule


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return True


def conv_bn_chains(module: nn.Module) -> list[str]:
    """``["conv+bn(+relu)", ...]`` in ``module``'s own forward (each link with a single user)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or hasattr(module, "qat_name"):
        return []
    if type(module).__module__.startswith("torch.nn.modules") and not isinstance(module, nn.Sequential):
        return []
    try:
        graph = _LeafTracer().trace(module)
    except Exception:  # noqa: BLE001 - not traceable: prepare will say so in its own report
        return []
    mods = dict(module.named_modules())
    found = []
    for n in graph.nodes:
        if n.op != "call_module" or type(mods.get(n.target)) is not nn.Conv2d or len(n.users) != 1:
            continue
        bn = next(iter(n.users))
        if bn.op != "call_module" or not isinstance(mods.get(bn.target), nn.BatchNorm2d):
            continue
        text = f"{n.target}+{bn.target}"
        if len(bn.users) == 1:
            r = next(iter(bn.users))
            if (r.op == "call_module" and type(mods.get(r.target)) is nn.ReLU) or \
                    (r.op == "call_function" and r.target is F.relu):
                text += f"+{r.target if r.op == 'call_module' else 'relu'}"
        found.append(text)
    return found


@rule("conv_bn_relu")
class ConvBnReLURule:
    """Report-only: modules whose forward has Conv2d+BN(+ReLU) chains (prepare_qat fuses them)."""

    claims_subtree = False  # other rules may still replace modules inside

    def match(self, module, name) -> bool:
        return bool(conv_bn_chains(module))

    def build(self, module, hardware):
        return module  # no change: prepare_qat's fusion is the replacement

    def describe(self, module, name) -> str:
        chains = conv_bn_chains(module)
        return f"prepare_qat fuses {len(chains)} chain(s): {', '.join(chains)}"

    def why_nothing(self, hardware):
        return "no Conv2d -> BatchNorm2d chain in any traceable forward"
