"""Float chains as one step: connected float nodes run by one step with direct numpy calls.

A decoder's decode graph at batch 1 is hundreds of small float nodes on [1, 1, 256]-sized
tensors (the FP16 islands' Cast round trips, RMSNorm's Pow / ReduceMean / Add / Sqrt / Div / Mul,
rotary's Mul / Slice / Neg / Concat / Add, the SiLU island's Sigmoid / Mul, head-split Reshape /
Transpose, the KV cache's Unsqueeze / Expand / Reshape for grouped heads). Run node by node,
each costs a few microseconds of checks and bookkeeping around a sub-microsecond numpy call. ``fuse`` groups connected steps of such nodes (``FUSABLE``) into
one ``ChainStep`` that runs them back to back as a small program of the same numpy calls.

Contract: a ChainStep's outputs equal, bit for bit on every element (NaN, inf and float16
rounding boundaries included), what its nodes compute one by one, because each member computes
its node's own formula (ops_float, ops_reduce: the same numpy calls on the same types, only the
per-call type checks and attribute parsing done once at load):

  * Cast float32 <-> float16 (or to the same type): ``x.astype(to)`` (torch's conversion from
    4096 elements on, as ops_float's Cast), overflow to +-inf;
  * Add, Sub, Mul, Div on equal float types: one IEEE operation in float32, float16 computed in
    float32 and rounded once;
  * Pow: ``np.power`` with the exponent in float32; Sqrt, Neg: numpy's;
  * ReduceMean: ``T(sum float64(x) / float64(n))``; Softmax: ops_float's formula;
  * Sigmoid, Reshape, Transpose, Slice, Concat, Unsqueeze, Squeeze, Expand (and a Cast of 4096 elements
    or more): ops_float's functions themselves, called directly, their constant inputs and
    attributes bound at load.

A chain runs its program only when each of its non-constant inputs is a float32 or float16
numpy array (what the members' formulas were written for); otherwise, or when any member's
call raises, it runs its members' node steps one by one, which give the nodes' own results and
named errors. Only tensors read solely inside a chain stay inside it; every tensor read by
another step, or a graph output, is among the chain's outputs. ``Session.run(...,
return_intermediates=True)``, ``run_layerwise`` and ``run_teacher_forced`` run the unfused
steps (every tensor, each forcible). ``dal.npu.load(..., fuse_chains=False)`` turns fusion off.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from .errors import NPUError

_F32, _F16 = np.dtype(np.float32), np.dtype(np.float16)
_FLOATS = (_F32, _F16)
_HALF_PAIR = {_F32, _F16}
#: op types a chain may hold (module doc); data ops take constant non-data inputs only
FUSABLE = frozenset({"Cast", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Neg", "Sigmoid", "ReduceMean",
                     "Softmax", "Reshape", "Transpose", "Slice", "Concat", "Unsqueeze", "Squeeze", "Expand"})
#: ops whose every input is data (the others: input 0 is data, the rest must be constants)
_ALL_DATA = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Concat"})


class ChainNode(SimpleNamespace):
    """What a ChainStep shows as its ``node``: ``name`` (its last member's), ``op_type``
    ("FloatChain"), ``members`` (the node names, in order)."""


def _compute(x):
    return x.astype(np.float32) if x.dtype == _F16 else x


def _cast_fn(n, a, opset):
    """A float-to-float Cast's program function (ops_float's Cast for these types), or None."""
    from .ops_float import OPS
    from .tensors import np_dtype

    try:
        to = np_dtype(a["to"], n)
    except Exception:
        return None
    if to not in _FLOATS:
        return None
    ctx = SimpleNamespace(node=n, opset=opset, threads=1)
    node_cast = OPS["Cast"]

    def cast(ins):
        x = ins[0]
        if x.size >= 4096 and {x.dtype, to} == _HALF_PAIR:  # the node's own (torch's) conversion
            return node_cast(ctx, ins, a)[0]
        if x.dtype == to or x.dtype == _F16:  # cannot overflow: no error state to set
            return x.astype(to)
        with np.errstate(over="ignore"):
            return x.astype(to)
    return cast


def _mean_fn(names, a, consts, opset):
    """ReduceMean's program function over constant, non-empty axes (ops_reduce's mean_once:
    ``T(sum float64(x) / float64(n))``), or None."""
    if opset < 18:
        axes = a.get("axes")
    else:
        axes = np.asarray(consts[names[1]]).reshape(-1).tolist() if len(names) > 1 and names[1] else None
    if not axes:  # all axes, or noop_with_empty_axes: left to the node
        return None
    axes, keep = [int(v) for v in axes], bool(a.get("keepdims", 1))

    def mean(ins):
        x = ins[0]
        nd = max(x.ndim, 1)
        if x.dtype.kind != "f" or not all(-x.ndim <= v < nd for v in axes):
            raise ValueError("input type or axis")
        ax = tuple(v % nd for v in axes)
        if len(set(ax)) != len(ax):
            raise ValueError("repeated axis")
        count = math.prod(x.shape[i] for i in ax)
        # np.add.reduce is what ndarray.sum calls: the same float64 sum
        return np.asarray(np.add.reduce(x.astype(np.float64), axis=ax, keepdims=keep) / np.float64(count)).astype(x.dtype)
    return mean


def _member_fn(step, consts, opset):
    """The member's program function ``f(ins) -> value`` for ``step`` (one output), or None
    when its node is not fusable (op type, attributes, non-constant parameters, types)."""
    from .ops_float import OPS
    from .tensors import is_float

    n, g = step.node, step.g
    op = n.op_type
    if op not in FUSABLE or n.domain not in ("", "ai.onnx") or len([o for o in n.output if o]) != 1:
        return None
    a = g.attrs(n)
    names = list(n.input)
    if op not in _ALL_DATA and any(i and i not in consts for i in names[1:]):
        return None
    if op == "Cast":
        return _cast_fn(n, a, opset)
    if op in ("Add", "Sub", "Mul", "Div"):
        fn = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.true_divide}[op]
        if len(names) != 2:
            return None

        def binary(ins):
            x, y = ins
            if x.dtype not in _FLOATS or y.dtype not in _FLOATS or (x.dtype != y.dtype and op != "Div"):
                raise TypeError("input types")
            if x.dtype == _F32 and y.dtype == _F32:
                return fn(x, y)
            return fn(_compute(x), _compute(y)).astype(x.dtype)
        return binary
    if op == "Pow":
        def power(ins):
            x, y = ins
            if x.dtype not in _FLOATS:
                raise TypeError("input type")
            e = _compute(y).astype(np.float32) if is_float(y) else y
            return np.power(_compute(x), e).astype(x.dtype)
        return power
    if op in ("Sqrt", "Neg"):
        f = np.sqrt if op == "Sqrt" else np.negative

        def unary(ins):
            x = ins[0]
            if x.dtype not in _FLOATS:
                raise TypeError("input type")
            return np.asarray(f(_compute(x))).astype(x.dtype)
        return unary
    if op == "ReduceMean":
        return _mean_fn(names, a, consts, opset)
    if op == "Softmax":
        if opset < 13:
            return None
        axis = a.get("axis", -1)

        def softmax(ins):
            x = ins[0]
            x32 = _compute(x)
            # torch's amax (15x numpy's max over 128-element rows): the same maximum, NaN
            # propagated, an empty axis raises; only a zero's sign may differ, and x - (+-0)
            # then differs only in a zero's sign, which exp maps to 1 either way (rank 0: numpy's
            # max, as before)
            if x32.ndim:
                import torch
                m = torch.from_numpy(np.ascontiguousarray(x32)).amax(dim=axis, keepdim=True).numpy()
            else:
                m = x32.max(axis=axis, keepdims=True)
            e = np.exp(x32 - m)
            return (e / e.sum(axis=axis, keepdims=True, dtype=np.float64).astype(x32.dtype)).astype(x.dtype)
        return softmax
    # Sigmoid and data movement: ops_float's own function, constant inputs and attributes bound once
    ctx = SimpleNamespace(node=n, opset=opset, threads=1)
    fn = OPS[op]
    if op in _ALL_DATA:
        return lambda ins: fn(ctx, ins, a)[0]
    fixed = [None if not i else consts[i] for i in names[1:]]
    return lambda ins: fn(ctx, [ins[0]] + fixed, a)[0]


class ChainStep:
    """Connected float node steps run as one step (module doc). ``parts``: the node steps, in
    graph order; ``inputs`` / ``outputs``: the tensors it reads from / hands to other steps."""

    kind = "chain"
    nhwc_capable, nhwc_in, nhwc_out = None, (), False

    def __init__(self, parts, program, inputs, outputs):
        self.parts, self.program = parts, program
        self.inputs, self.outputs, self.extra_outputs = inputs, outputs, []
        last = parts[-1].node
        self.node = ChainNode(name=last.name, op_type="FloatChain", members=[p.node_name for p in parts])
        self.node_name = last.name
        self.dynamic = [k for k, i in enumerate(inputs) if i and not program["const"].get(i, False)]
        self.use_program = True

    def run(self, ins, threads, want_extra=False):
        if self.use_program:
            if all(type(ins[k]) is np.ndarray and ins[k].dtype in _FLOATS for k in self.dynamic):
                vals = list(ins) + self.program["blank"]  # slots: the inputs, None, each member's output
                try:
                    for fn, args, out in self.program["ops"]:
                        vals[out] = fn([vals[j] for j in args])
                    return {o: vals[j] for o, j in self.program["out"]}
                except Exception:  # the node steps below give the nodes' results or named errors
                    pass
            else:  # e.g. integer inputs: this chain's program never applies to this graph's types
                self.use_program = False
        return self._one_by_one(ins, threads)

    def _one_by_one(self, ins, threads):
        from .session import run_member
        env = dict(zip(self.inputs, ins))
        consts = self.program["consts"]
        for p in self.parts:
            pins = [None if not i else env[i] if i in env else consts[i] for i in p.inputs]
            try:
                env.update(run_member(p, pins, threads))
            except NPUError:
                raise
            except Exception as e:
                err = NPUError(f"node {p.node_name!r} ({p.node.op_type}) failed: {type(e).__name__}: {e}")
                err.node_named = True
                raise err from None
        return {o: env[o] for o in self.outputs}


def fuse(steps, live, graph, consts, outputs, keep=frozenset()):
    """``steps`` with connected live float node steps (``FUSABLE``) merged into ChainSteps, each
    placed where its last member was. ``consts``: constant values by name (initializers and
    load-time folded values); ``outputs``: the graph's outputs; ``keep``: tensor names no chain
    may hold inside or read (pixel-major tensors). A chain holds at least two steps; a tensor
    read outside its chain before the chain's place keeps its producer out (no reordering)."""
    from .session import NodeStep

    opset = graph.opset
    fns, readers, producer = {}, {}, {}
    for k, (st, is_live) in enumerate(zip(steps, live)):
        for i in st.inputs:
            if i:
                readers.setdefault(i, []).append(k)
        for o in st.outputs:
            producer[o] = k
        if (is_live and type(st) is NodeStep and not any(i in keep for i in st.inputs if i)
                and not any(o in keep for o in st.outputs)):
            try:
                f = _member_fn(st, consts, opset)
            except Exception:
                f = None
            if f is not None:
                fns[k] = f
    group = {}  # step index -> group id (the index of its first member)
    members: dict[int, list[int]] = {}
    outs = set(outputs)
    for k in sorted(fns):
        st = steps[k]
        cand = set()
        for i in st.inputs:
            j = producer.get(i) if i and i not in consts else None
            if j is not None and j in group:
                cand.add(group[j])
        mine = [k]
        for gid in sorted(cand):
            # every tensor the group makes that a step outside (group, k) reads before k: refuse
            ok = True
            for m in members[gid]:
                for o in steps[m].outputs:
                    if any(r < k and r != k and group.get(r) != gid for r in readers.get(o, ())):
                        ok = False
            if ok:
                mine = members.pop(gid) + mine
        gid = min(mine)
        for m in mine:
            group[m] = gid
        members[gid] = sorted(mine)
    chains = {max(ms): ms for ms in members.values() if len(ms) > 1}
    in_chain = {m for ms in chains.values() for m in ms}
    out = []
    for k, st in enumerate(steps):
        if k in chains:
            out.append(_chain(steps, chains[k], fns, readers, outs, consts))
        elif k not in in_chain:
            out.append(st)
    return out


def _chain(steps, ms, fns, readers, outs, consts):
    mset = set(ms)
    made, ins, const_in, ops = set(), [], {}, []
    for m in ms:
        st = steps[m]
        for i in st.inputs:
            if i and i not in made and i not in ins:
                ins.append(i)
                const_in[i] = i in consts and i not in made
        ops.append((fns[m], [i for i in st.inputs], st.outputs[0]))
        made.update(o for o in st.outputs if o)
    extern = [o for m in ms for o in steps[m].outputs
              if o and (o in outs or any(r not in mset for r in readers.get(o, ())))]
    # the program's values live in a list: the chain's inputs (constants too: the session hands
    # them in), then None for absent optional inputs, then each member's output
    slot = {i: k for k, i in enumerate(ins)}
    slot[""] = len(ins)
    for k, (_, _, o) in enumerate(ops):
        slot[o] = len(ins) + 1 + k
    program = {"ops": [(fn, tuple(slot[i] for i in args), slot[o]) for fn, args, o in ops],
               "blank": [None] * (1 + len(ops)), "out": [(o, slot[o]) for o in extern],
               "const": const_in, "consts": consts}
    return ChainStep([steps[m] for m in ms], program, ins, extern)
