"""Which tensors of a graph are provably of rank 4 (the only ones layout.py may store pixel-major).

The planner has no shapes at load (the batch, and often more, is symbolic), so a rank is proven
from the file alone, and a tensor with no proof is never reordered:

* declared: a graph input, output or ``value_info`` with a shape of four dimensions (symbolic
  dimensions count), an initializer or Constant of rank 4;
* a 2-D convolution (``Conv`` / ``ConvInteger`` with a rank-4 weight, ``QLinearConv`` likewise):
  ONNX requires X and Y to have the weight's rank;
* rank-keeping nodes (Q / DQ, elementwise unary ops, pooling, normalization, Resize, ...): input 0
  and output 0 have the same rank, so a proof crosses them in either direction;
* broadcasting nodes (Add, Mul, ...): the output has the largest rank of the inputs, so it is of
  rank 4 when one input is and every other input is proven rank 4 or is a constant of rank <= 4;
  nothing is concluded about the inputs;
* Concat: every input has the output's rank.

    rank4_names(g) -> set of tensor names

A transformer's rank-3 activations ([N, tokens, C]) and rank-1 / rank-2 tensors have no proof
and stay as they are.
"""
from __future__ import annotations

import numpy as np

#: input 0 and output 0 have the same rank
_RANK_KEEPING = {
    "QuantizeLinear", "DequantizeLinear", "Relu", "Clip", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid",
    "HardSwish", "Tanh", "Erf", "Gelu", "Exp", "Log", "Neg", "Abs", "Sqrt", "Reciprocal", "Floor", "Ceil",
    "Round", "Sign", "Identity", "Cast", "Elu", "Selu", "Softplus", "Softsign", "Mish", "Dropout",
    "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool",
    "BatchNormalization", "InstanceNormalization", "LRN", "Resize", "Upsample", "DepthToSpace",
    "SpaceToDepth", "Pad", "Softmax", "LogSoftmax", "Hardmax", "LayerNormalization",
}
#: numpy broadcasting: the output has the largest rank of the inputs
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean", "Pow", "Where"}
#: (data input, weight input) of the convolutions
_CONV = {"Conv": (0, 1), "ConvInteger": (0, 1), "QLinearConv": (0, 3)}


def _declared(g) -> set:
    """Names declared or stored with rank 4 in the file."""
    out = {name for name, v in g.consts.items() if np.ndim(v) == 4}
    gr = g.model.graph
    for vi in list(gr.input) + list(gr.value_info) + list(gr.output):
        t = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and t.HasField("shape") and len(t.shape.dim) == 4:
            out.add(vi.name)
    return out


def _weight_rank(g, name, known):
    """The rank of a convolution weight: a constant, a DequantizeLinear of one, or declared."""
    c = g.const(name)
    if c is None:
        p = g.producer(name)
        if p is not None and p.op_type == "DequantizeLinear" and p.input:
            c = g.const(p.input[0])
    if c is not None:
        return np.ndim(c)
    return 4 if name in known else None


def rank4_names(g) -> set:
    """Tensor names of ``g`` (a graph.Graph) provably of rank 4 (module docstring), to a fixed point."""
    known = _declared(g)
    changed = True
    while changed:
        changed = False

        def add(name):
            nonlocal changed
            if name and name not in known:
                known.add(name)
                changed = True

        for n in g.nodes:
            if n.domain not in ("", "ai.onnx") or not n.output:
                continue
            op, out = n.op_type, n.output[0]
            if op in _CONV:
                x, w = _CONV[op]
                if len(n.input) > w and _weight_rank(g, n.input[w], known) == 4:
                    add(n.input[x])
                    add(out)
            elif op in _RANK_KEEPING and n.input:
                if n.input[0] in known:
                    add(out)
                elif out in known:
                    add(n.input[0])
            elif op in _BROADCAST:
                ins = [i for i in n.input if i]
                four = any(i in known for i in ins)
                rest_ok = all(i in known or (g.const(i) is not None and np.ndim(g.const(i)) <= 4) for i in ins)
                if four and rest_ok:
                    add(out)
            elif op == "Concat":
                names = [i for i in n.input if i] + [out]
                if any(i in known for i in names):
                    for i in names:
                        add(i)
    return known
