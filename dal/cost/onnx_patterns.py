"""Node patterns of an exported ONNX graph that are one layer: the nodes one module or function
of the model exported, which the chip runs as one operation, so that :mod:`dal.cost.onnx_graph`
charges them as the one layer :mod:`dal.cost.torch_graph` charges for that module.

- **a gated activation** ``Mul(x, f(x))``: ``f`` a chain of element-wise nodes reading ``x``
  alone (any other input a constant), at least one node not plain arithmetic (a Sigmoid, an
  Erf...: ``x * (x + 1)`` stays two layers), each intermediate read only by the next; a following
  ``Mul`` / ``Div`` by a constant in the same ONNX scope (written by the same module) joins it.
  SiLU is ``Mul(x, Sigmoid(x))``, HardSwish below opset 14 ``Mul(x, HardSigmoid(x))``, GELU's
  Erf form ``Mul(Mul(x, Add(Erf(Div(x, c)), c)), 0.5)``, Mish ``Mul(x, Tanh(Softplus(x)))``
  (export/SPEC.md §5a, §6 ``lut_activation``). It is one ``activation`` layer of the first
  activation op of :mod:`dal.ops` whose ONNX pattern holds every node type of it (its
  ``function``): the chip evaluates the chain as one function of each input element, one
  lookup table on codes (``dal/npu/fused_codes.py``). ``x * torch.sigmoid(x)`` written in a
  forward of a prepared model is no gate: prepare makes the product a QMul, whose Mul reads two
  DequantizeLinears; left unquantized it would be the same nodes as ``F.silu``, one layer here
  where the traced model charges its two calls.
- **a normalisation** (export/SPEC.md §5a): RMSNorm ``Pow(x, 2) -> ReduceMean -> Add(eps) ->
  Sqrt -> Div(1, .) | Reciprocal -> Mul(x, .)`` (or ``Div(x, Sqrt(.))``), LayerNorm below
  opset 17 ``ReduceMean(x) -> Sub(x, .) = d -> Pow(d, 2) -> ReduceMean -> Add(eps) -> Sqrt ->
  Div(d, .)``; ``Mul(d, d)`` may stand for the Pow; then, past any float Casts (an FP16
  island's round trip), a ``Mul`` by a constant (the weight) and an ``Add`` of a constant (the
  bias). One ``layernorm`` layer (``LayerNormalization``, the single node of opset 17, is one
  already: :mod:`dal.cost.op_costs`).
- **an embedding**: ``Gather(table, indices)`` along axis 0 of a 2-D initializer, or of a
  ``DequantizeLinear`` of one: an ``embedding`` layer, as dal.ops' ``embedding`` op exports.
- **a bias** (:func:`bias_adds`): the ``Add`` of a constant after a matrix node is part of it.

Every intermediate value of a pattern is read only inside it (else the nodes stay separate
layers). A pattern's input elements are those of ``x`` (an embedding: none), its output
elements those of its last node's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import ops

#: element-wise node types with one data input (any other input a constant)
UNARY = frozenset({"Sigmoid", "HardSigmoid", "Tanh", "Erf", "Softplus", "Add", "Sub", "Mul", "Div", "Neg",
                   "Exp", "Abs", "Relu", "Clip", "Cast", "Sqrt", "Reciprocal", "Pow"})
#: the node types of a gate that are plain arithmetic: a gate needs one more (Sigmoid, Erf...)
ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Pow", "Reciprocal", "Sqrt"})


@dataclass(frozen=True)
class Pattern:
    """One layer made of several nodes (module docstring): ``members`` the node indices,
    ``anchor`` the last of them (where the layer is listed), ``op_class`` / ``function`` what it
    is charged as, ``x`` its data input, ``out`` its output, ``weight`` a normalisation's weight
    operand or an embedding's table (else None)."""

    members: frozenset
    anchor: int
    op_class: str
    function: str
    x: Optional[str]
    out: str
    weight: Optional[str] = None


class _View:
    def __init__(self, g, const: set):
        self.g, self.const = g, const
        self.index = {id(n): i for i, n in enumerate(g.nodes)}

    def producer(self, name: str, *types):
        n = self.g.producer.get(name)
        return n if n is not None and (not types or n.op_type in types) else None

    def consumers(self, name: str) -> list:
        return self.g.consumers.get(name, [])

    def only_consumer(self, name: str, *types):
        cs = self.consumers(name)
        if len(cs) == 1 and (not types or cs[0].op_type in types) and name not in self.g.outputs:
            return cs[0]
        return None

    def data(self, node) -> list:
        return [i for i in node.input if i and i not in self.const]

    def constant_like(self, name: str) -> bool:
        """A constant, or a DequantizeLinear of constants (a quantized weight)."""
        dq = self.producer(name, "DequantizeLinear")
        return name in self.const or (dq is not None and all(i in self.const for i in dq.input if i))

    def other(self, node, name: str) -> Optional[str]:
        """The input of a two-input ``node`` that is not ``name`` (None when both are)."""
        a, b = node.input[0], node.input[1]
        return b if a == name and b != name else a if b == name and a != name else None


def _scope(node) -> str:
    return node.name.rsplit("/", 1)[0] if "/" in node.name else ""


def _closed(v: _View, members: list, out: str) -> bool:
    """Every value a member writes, but ``out``, is read by members only."""
    ids = {id(n) for n in members}
    return all(all(id(c) in ids for c in v.consumers(o)) and o not in v.g.outputs
               for n in members for o in n.output if o != out)


def _gated(v: _View, mul) -> Optional[Pattern]:
    if mul.op_type != "Mul" or len(mul.input) != 2 or len(v.data(mul)) != 2:
        return None
    for x, y in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
        chain, name = [], y
        while name != x and len(chain) < 6:
            n = v.producer(name, *UNARY)
            if n is None or v.data(n) != [n.input[0]]:
                break
            chain.append(n)
            name = n.input[0]
        if name != x or not chain:
            continue
        members = chain[::-1] + [mul]
        tail = v.only_consumer(mul.output[0], "Mul", "Div")
        if tail is not None and _scope(tail) == _scope(mul) and len(v.data(tail)) == 1 \
                and tail.input[0] == mul.output[0]:
            members.append(tail)
        types = {n.op_type for n in members if n.op_type != "Cast"}
        if not types - ARITHMETIC:  # x * (x + 1): arithmetic, as the model wrote it
            continue
        op = next((o for o in ops.select(op_class="activation") if o.cost == "vector" and "Mul" in o.onnx
                   and types <= set(o.onnx)), None)
        out = members[-1].output[0]
        if op is None or not _closed(v, members, out):
            continue
        return Pattern(frozenset(v.index[id(n)] for n in members), v.index[id(members[-1])], op.op_class,
                       op.function or op.name, x, out)
    return None


def _affine_tail(v: _View, name: str, members: list) -> tuple:
    """Past float Casts, a Mul by a constant then an Add of a constant: (output, weight)."""
    weight = None
    for kind in ("Mul", "Add"):
        casts, cur = [], name
        while (c := v.only_consumer(cur, "Cast")) is not None:
            casts.append(c)
            cur = c.output[0]
        n = v.only_consumer(cur, kind)
        w = v.other(n, cur) if n is not None and len(n.input) == 2 else None
        if w is None or not v.constant_like(w):
            break
        members.extend(casts + [n])
        name = n.output[0]
        weight = weight or w
    return name, weight


def _norm(v: _View, sqrt) -> Optional[Pattern]:
    add = v.producer(sqrt.input[0], "Add")
    ms = add is not None and len(v.data(add)) == 1 and v.data(add)[0]
    rm = ms and v.producer(ms, "ReduceMean")
    sq = rm and v.producer(rm.input[0], "Pow", "Mul")
    if not sq:
        return None
    d = sq.input[0]
    if not ((sq.op_type == "Pow" and sq.input[1] in v.const) or (sq.op_type == "Mul" and sq.input[1] == d)):
        return None
    members, x = [sq, rm, add, sqrt], d
    sub = v.producer(d, "Sub")
    mean = sub is not None and v.producer(sub.input[1], "ReduceMean")
    if mean and sub.input[0] == mean.input[0]:  # LayerNorm: d = x - mean(x)
        members[:0] = [mean, sub]
        x = sub.input[0]
    step = v.only_consumer(sqrt.output[0], "Div", "Reciprocal")
    if step is None:
        return None
    if step.op_type == "Div" and step.input[0] == d:  # d / sqrt(.)
        members.append(step)
    else:
        if step.op_type == "Div" and not (step.input[1] == sqrt.output[0] and step.input[0] in v.const):
            return None
        scale = v.only_consumer(step.output[0], "Mul")
        if scale is None or v.other(scale, step.output[0]) != d:
            return None
        members += [step, scale]
    out, weight = _affine_tail(v, members[-1].output[0], members)
    if not _closed(v, members, out):
        return None
    members.sort(key=lambda n: v.index[id(n)])
    return Pattern(frozenset(v.index[id(n)] for n in members), v.index[id(members[-1])], "layernorm", "", x, out,
                   weight)


def _embedding(v: _View, gather) -> Optional[Pattern]:
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    table = gather.input[0]
    dq = v.producer(table, "DequantizeLinear")
    src = dq.input[0] if dq is not None else table
    init = v.g.inits.get(src)
    if axis != 0 or init is None or len(init.dims) != 2:
        return None
    i = v.index[id(gather)]
    return Pattern(frozenset({i}), i, "embedding", "", None, gather.output[0], table)


def find_patterns(g, const: set) -> list[Pattern]:
    """The patterns (module docstring) of graph ``g`` (:class:`dal.cost.onnx_graph._Graph`:
    ``nodes`` in topological order, ``producer``, ``consumers``, ``inits``, ``outputs``), ``const``
    the values computed without the graph's data. A node belongs to one pattern at most."""
    v = _View(g, const)
    found, taken = [], set()
    finders = {"Sqrt": _norm, "Mul": _gated, "Gather": _embedding}
    # normalisations first: their Muls are not gates
    for kinds in (("Sqrt",), ("Mul", "Gather")):
        for node in g.nodes:
            if node.op_type in kinds and v.index[id(node)] not in taken:
                p = finders[node.op_type](v, node)
                if p is not None and not (p.members & taken):
                    found.append(p)
                    taken |= p.members
    return found


def bias_adds(g, const: set, matrix_types) -> dict:
    """matrix node index -> index of the ``Add`` of its bias: a node of ``matrix_types`` with a
    constant weight (its second input a constant or a DequantizeLinear of constants) whose
    output only an ``Add`` in the same ONNX scope (written by the same module) reads, the other
    operand a constant whose tensor (a DequantizeLinear's codes) is named ``<...>.bias<...>``.
    A ``Linear`` on a 3-D input exports as ``MatMul`` then that ``Add``; the traced model charges
    the module, bias included, as one layer (a ``Conv`` / ``Gemm`` holds its bias itself). An
    ``x @ W + b`` a forward computes with its own tensors is two calls, two layers on both sides
    (its ``b`` is no module's ``.bias``)."""
    v = _View(g, const)
    out = {}
    for i, node in enumerate(g.nodes):
        if node.op_type not in matrix_types or len(node.input) < 2 or not v.constant_like(node.input[1]):
            continue
        add = v.only_consumer(node.output[0], "Add")
        bias = v.other(add, node.output[0]) if add is not None and len(add.input) == 2 else None
        if bias is None or _scope(add) != _scope(node) or not v.constant_like(bias):
            continue
        dq = v.producer(bias, "DequantizeLinear")
        if ".bias" in (dq.input[0] if dq is not None else bias):
            out[i] = v.index[id(add)]
    return out
