"""Einsum without a summed index (RT-DETR's position embedding, ``grid.outer(omega)`` exports as
``Einsum("i,j->ij")``), node by node.

    y[out] = a[idx_a] * b[idx_b]     every index of the inputs appears in the output

One IEEE multiplication per element (export/SPEC.md §5a), so any two engines agree. An equation
with a summed index (a contraction: its summation order would need a rule), more than two
operands, or an ellipsis is refused naming the node.
"""
from __future__ import annotations

import numpy as np

from .errors import UnsupportedNode
from .ops_float import op


@op("Einsum")
def _einsum(ctx, ins, a):
    eq = a.get("equation", "")
    eq = eq.decode() if isinstance(eq, bytes) else str(eq)
    eq = eq.replace(" ", "")
    lhs, _, out = eq.partition("->")
    terms = lhs.split(",")
    types = [str(np.asarray(x).dtype) for x in ins]
    if not _ or "." in eq or len(terms) != 2 or len(ins) != 2:
        raise UnsupportedNode(ctx.node, types, f"Einsum {eq!r}: only 'ab,cd->out' forms of two operands with an explicit output")
    if set("".join(terms)) - set(out) or any(len(set(t)) != len(t) for t in terms):
        raise UnsupportedNode(ctx.node, types, f"Einsum {eq!r}: a summed or repeated index (a contraction) is not part of the contract")
    x, y = np.asarray(ins[0]), np.asarray(ins[1])
    if x.dtype != y.dtype:
        raise UnsupportedNode(ctx.node, types, "Einsum of operands of different types")

    def spread(v, term):  # v's axes moved to their place in the output, size 1 elsewhere
        v = np.transpose(v, [term.index(c) for c in out if c in term])
        return v.reshape([v.shape[[c for c in out if c in term].index(c)] if c in term else 1 for c in out])
    return [np.asarray(spread(x, terms[0]) * spread(y, terms[1])).astype(x.dtype)]
