"""Rule ``conv_bn_relu``: report the Conv2d -> BatchNorm2d (-> ReLU) chains the NPU runs fused.

A report-only rule: ``prepare_qat`` already fuses every such chain it finds in a module's own
forward into ``QConvBn2d`` / ``QConvBnReLU2d`` (BN folded into the weights, as the hardware
runs it), so this rule changes nothing; it lists the chains, so a model whose convolutions
would *not* fuse (a BN used twice, a conv output consumed elsewhere) shows up before training.
"""
from __future__ import annotations

from torch import nn

from ..nn.own_forward import find_conv_bn, needs_tracing, trace_own_forward
from .registry import rule


def conv_bn_chains(module: nn.Module) -> list[str]:
    """``["conv+bn(+relu)", ...]``: the chains ``prepare_qat`` will fuse in ``module``'s own
    forward (the same finder, :func:`dal.nn.own_forward.find_conv_bn`)."""
    if not needs_tracing(module):
        return []
    try:
        graph = trace_own_forward(module)
    except Exception:  # noqa: BLE001 - not traceable: prepare will say so in its own report
        return []
    found = []
    for p in find_conv_bn(graph, module):
        relu = p.relu_node
        tail = "" if relu is None else f"+{relu.target if relu.op == 'call_module' else 'relu'}"
        found.append(f"{p.conv}+{p.bn}{tail}")
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
