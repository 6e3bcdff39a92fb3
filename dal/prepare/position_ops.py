"""Position arithmetic in a traced forward: computed from integer positions, never quantized.

A rotary embedding (transformers' ``LlamaRotaryEmbedding`` and its copies) turns integer
``position_ids`` into cos / sin tables: ``positions.float() * inv_freq``, ``cat((f, f))``,
``cos``, ``sin``. Those values depend only on the positions (and on buffers), not on any
activation, so the chip does not compute them in the quantized graph: a deployment feeds the
tables (or computes them on the host). Prepare gives their ``+ * @ cat`` no quantizer; the
tables are quantized where an activation meets them (the rotary multiply inside attention).

:func:`position_arithmetic` says whether a node of a traced forward is such arithmetic, from the
graph alone (prepare has no example data): every data path from the forward's arguments to the
node passes through a cast to a floating dtype (``.float()``, ``.to(torch.float32)``) applied,
through reshapes and indexing only, directly to an argument that is not the forward's first
(the activation; a rotary embedding's ``x`` is read only for its device and dtype), and at
least one such path exists. Reading an argument's ``.device`` / ``.dtype`` / ``.shape`` is no
data path; buffers and constants are no arguments.
"""
from __future__ import annotations

import operator

import torch

_FLOAT_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
_CAST_METHODS = {"float", "double", "half", "bfloat16"}
_SHAPE_METHODS = {"unsqueeze", "view", "reshape", "expand", "squeeze", "transpose", "permute", "contiguous",
                  "flatten", "clone", "__getitem__"}
_META_KEYS = {"device", "dtype", "memory_format", "non_blocking", "copy"}


def position_arithmetic(node) -> bool:
    """Whether fx node ``node`` computes only from integer position arguments cast to float,
    buffers and constants (module doc)."""
    first = _first_placeholder(node.graph)
    stack, seen, found = list(_data_inputs(node)), set(), False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" or _metadata(n):
            continue
        if n.op == "placeholder":
            return False  # an argument reaches the node without a cast: activation data
        if _float_cast(n):
            source = _through_shape_ops(n.args[0]) if n.args else None
            if source is not None and source.op == "placeholder" and source is not first:
                found = True
                continue
        stack += _data_inputs(n)
    return found


def _first_placeholder(graph):
    return next((n for n in graph.nodes if n.op == "placeholder"), None)


def _data_inputs(node) -> list:
    out = []
    values = list(node.args) + [v for k, v in node.kwargs.items() if k not in _META_KEYS]
    for a in values:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if hasattr(x, "op") and hasattr(x, "args"):
                out.append(x)
    return out


def _metadata(node) -> bool:
    """``getattr(x, "device")`` and the like: a property of a tensor, not its values."""
    return node.op == "call_function" and node.target is getattr


def _float_cast(node) -> bool:
    if node.op != "call_method":
        return False
    if node.target in _CAST_METHODS:
        return True
    if node.target == "to":
        dtypes = [a for a in node.args[1:] if isinstance(a, torch.dtype)] + [node.kwargs.get("dtype")]
        return any(d in _FLOAT_DTYPES for d in dtypes)
    return False


def _through_shape_ops(node):
    """The node reached from ``node`` through reshapes and indexing (its first argument each time)."""
    while hasattr(node, "op") and ((node.op == "call_method" and node.target in _SHAPE_METHODS) or
                                   (node.op == "call_function" and node.target is operator.getitem)):
        node = node.args[0]
    return node if hasattr(node, "op") else None
