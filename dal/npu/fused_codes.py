"""Groups that stay on integer codes without any arithmetic change (exact by construction).

* ``DQ -> MaxPool -> Q`` (scalar parameters, 8-bit codes, scale > 0): DequantizeLinear is
  non-decreasing in the code and max commutes with non-decreasing maps, so
  ``Q(max DQ(x)) == T[max x]`` with the 256-entry table ``T[c] = Q(DQ(c))``. The max runs on
  the codes (csrc/pool_codes.cpp); padding is ignored as with -inf.
* ``DQ(a), DQ(b) -> Add | Sub | Mul | Max | Min [-> Relu | Clip] -> Q`` (8-bit codes, scalar
  parameters): every float op in the chain is elementwise and correctly rounded, so the result
  for an element depends only on its two codes: ``T[a, b] = Q(act(DQ(a) op DQ(b)))``, a
  65536-entry table computed at load by the very same numpy functions the node-by-node path
  uses (quant.py, ops_float.py). Broadcast inputs are expanded first.
* ``DQ(x) -> elementwise chain -> Q`` (8-bit codes, scalar parameters): nodes that each compute
  an element from the same element of their inputs (Cast to float / float16, Sigmoid, Tanh,
  Erf, Gelu, HardSigmoid, HardSwish, Relu, Clip, Add / Sub / Mul / Div, ...), whose other
  inputs are chain tensors or scalar constants and whose tensors nothing else reads, ending in
  one tensor read only by QuantizeLinear nodes. Each result depends on one code only:
  ``T[c] = Q(chain(DQ(c)))``, the chain evaluated node by node on all 256 codes at load. An
  FP16 island on integer codes (``DQ -> Cast16 -> Cast32 -> Sigmoid -> Mul -> Cast16 -> Cast32
  -> Q``) and a lookup-table activation (``DQ -> Mul(x, Sigmoid(x)) -> Q``) are such chains.

The tables are built once per Session; the float intermediates (return_intermediates) are
recomputed node by node only when asked for.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import quant

_8BIT = {np.dtype(np.int8), np.dtype(np.uint8)}
_BINARY = ("Add", "Sub", "Mul", "Max", "Min")


def _dq_params(g, name):
    """(dq node, scale, zp) when ``name`` is a DQ output with scalar float32 params and 8-bit codes."""
    n = g.producer(name)
    if n is None or n.op_type != "DequantizeLinear" or n.domain not in ("", "ai.onnx") or len(n.input) < 3:
        return None
    s, z = g.const(n.input[1]), g.const_opt(n, 2)
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != np.float32 or z.dtype not in _8BIT:
        return None
    a = g.attrs(n)
    if a.get("block_size", 0) or a.get("output_dtype", 0) or not np.isfinite(s).all() or float(s.reshape(())) <= 0:
        return None
    return n, np.float32(s.reshape(())), z.reshape(())


def _q_after(g, name):
    return _q_params(g, g.sole_consumer(name))


def _q_params(g, n):
    """(q node, scale, zp) when ``n`` is a QuantizeLinear with scalar float32 scale and 8-bit zp."""
    if n is None or n.op_type != "QuantizeLinear" or n.domain not in ("", "ai.onnx") or len(n.input) < 3:
        return None
    s, z = g.const(n.input[1]), g.const_opt(n, 2)
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != np.float32 or z.dtype not in _8BIT:
        return None
    a = g.attrs(n)
    if a.get("block_size", 0) or a.get("output_dtype", 0):
        return None
    return n, np.float32(s.reshape(())), z.reshape(())


def _codes(dt):
    lo, hi = quant.int_range(dt)
    return np.arange(lo, hi + 1).astype(dt), lo


class _CodeStep:
    kind = "codes"

    def _ctx(self, node, threads):
        return SimpleNamespace(node=node, opset=self.g.opset, threads=threads)

    def _float_chain(self, ins, threads):
        """The absorbed float nodes, node by node (only for return_intermediates)."""
        from .ops_float import OPS
        vals = {}
        for node in self.chain:
            args = [vals.get(i) if i in vals else ins.get(i, self.g.consts.get(i)) if i else None
                    for i in node.input]
            outs = OPS[node.op_type](self._ctx(node, threads), args, self.g.attrs(node))
            vals.update(zip(node.output, outs))
        return vals


class MaxPoolCodes(_CodeStep):
    nhwc_capable, nhwc_in, nhwc_out = True, (), False  # layout.py

    def __init__(self, g, node, dq, q):
        self.g, self.node, self.node_name = g, node, node.name
        (dqn, xs, xz), (qn, ys, yz) = dq, q
        self.inputs = [dqn.input[0]]
        self.outputs = [qn.output[0]]
        self.extra_outputs = [node.output[0]]
        self.absorbed = [qn]
        self.chain = [dqn, node]
        self.dq_out = dqn.output[0]
        codes, self.base = _codes(xz.dtype)
        self.x_dtype = xz.dtype
        t = quant.quantize(quant.dequantize(codes, xs, xz), ys, yz, yz.dtype)
        import torch
        self.lut = torch.from_numpy(np.ascontiguousarray(t))
        self.y_dtype = yz.dtype

    def run(self, ins, threads, want_extra=False):
        from .layout import to_nchw, to_nhwc
        x, nin = ins[0], bool(self.nhwc_in and self.nhwc_in[0])
        y = self._pool_nhwc(x, threads) if nin else None
        if y is None:
            out = self._run_nchw(to_nchw(x) if nin else x, threads, want_extra)
            if self.nhwc_out:
                out[self.outputs[0]] = to_nhwc(out[self.outputs[0]])
            return out
        out = {self.outputs[0]: y if self.nhwc_out else to_nchw(y)}
        if want_extra:
            out[self.node.output[0]] = self._float_chain({self.inputs[0]: to_nchw(x)}, threads)[self.node.output[0]]
        return out

    def _geometry(self, x_nchw, threads):
        """(kernel, strides, dilations, pads, oh, ow), or None where the float path must run."""
        from .ops_nn import pool_attrs
        ks, st, dil, pads, ceil = pool_attrs(self._ctx(self.node, threads), x_nchw, self.g.attrs(self.node))
        if ceil:
            return None
        n, c, h, w = x_nchw.shape
        oh = (h + pads[0] + pads[2] - dil[0] * (ks[0] - 1) - 1) // st[0] + 1
        ow = (w + pads[1] + pads[3] - dil[1] * (ks[1] - 1) - 1) // st[1] + 1
        return None if oh < 1 or ow < 1 else (ks, st, dil, pads, oh, ow)

    def _pool_nhwc(self, x, threads):
        """Pixel-major codes [N, OH, OW, C] of pixel-major x, or None (the NCHW path decides)."""
        from .build import kernels as lib
        import torch
        if x.dtype != self.x_dtype or x.ndim != 4:
            return None
        cache = self.__dict__.setdefault("_geo_nhwc", {})  # the attributes are fixed: once per shape
        if x.shape not in cache:
            cache[x.shape] = self._geometry(np.moveaxis(x, 3, 1), threads)
        geo = cache[x.shape]
        if geo is None:
            return None
        ks, st, dil, pads, oh, ow = geo
        try:
            return lib().maxpool_codes_nhwc(torch.from_numpy(np.ascontiguousarray(x)), ks[0], ks[1], st[0], st[1],
                                            dil[0], dil[1], pads[0], pads[1], oh, ow, self.lut, self.base,
                                            threads).numpy()
        except RuntimeError:  # a window entirely in padding: the float path
            return None

    def _run_nchw(self, x, threads, want_extra):
        from .build import kernels as lib
        from .errors import NPUError
        import torch
        ins = [x]
        if x.dtype != self.x_dtype or x.ndim != 4:
            raise NPUError(f"node {self.node_name!r}: MaxPool input codes {x.dtype} {x.shape}")
        geo = self._geometry(x, threads)
        if geo is None:
            return self._by_nodes(ins, threads, want_extra)
        (ks, st, dil, pads, oh, ow), (n, c) = geo, x.shape[:2]
        xt = torch.from_numpy(np.ascontiguousarray(x))
        try:
            ys = [lib().maxpool_codes(xt[b], ks[0], ks[1], st[0], st[1], dil[0], dil[1], pads[0],
                                      pads[1], oh, ow, self.lut, self.base, threads) for b in range(n)]
        except RuntimeError:  # a window entirely in padding: leave it to the float path
            return self._by_nodes(ins, threads, want_extra)
        # np.stack: torch.stack of uint8 tensors took ~19 ms here (thread-pool start-up)
        out = {self.outputs[0]: np.stack([y.numpy() for y in ys]).reshape(n, c, oh, ow)}
        if want_extra:
            out[self.node.output[0]] = self._float_chain({self.inputs[0]: x}, threads)[self.node.output[0]]
        return out

    def _by_nodes(self, ins, threads, want_extra):
        from .ops_float import OPS
        qn = self.absorbed[0]
        vals = self._float_chain({self.inputs[0]: ins[0]}, threads)
        y = OPS["QuantizeLinear"](self._ctx(qn, threads), [vals[self.node.output[0]]] +
                                  [self.g.consts.get(i) for i in qn.input[1:]], self.g.attrs(qn))[0]
        out = {self.outputs[0]: y}
        if want_extra:
            out[self.node.output[0]] = vals[self.node.output[0]]
        return out


class BinaryCodes(_CodeStep):
    nhwc_capable, nhwc_in, nhwc_out = "all", (), False  # layout.py: elementwise, any one layout

    def __init__(self, g, node, dqa, dqb, act, q):
        from .ops_float import OPS
        self.g, self.node, self.node_name = g, node, node.name
        (na, sa, za), (nb, sb, zb), (qn, ys, yz) = dqa, dqb, q
        self.inputs = [na.input[0], nb.input[0]]
        self.outputs = [qn.output[0]]
        self.extra_outputs = [node.output[0]] + ([act.output[0]] if act is not None else [])
        self.absorbed = ([act] if act is not None else []) + [qn]
        self.chain = [na, nb, node] + ([act] if act is not None else [])
        self.dtypes = (za.dtype, zb.dtype)
        ca, self.base_a = _codes(za.dtype)
        cb, self.base_b = _codes(zb.dtype)
        A, B = np.meshgrid(ca, cb, indexing="ij")
        ctx = self._ctx(node, 1)
        v = OPS[node.op_type](ctx, [quant.dequantize(A, sa, za), quant.dequantize(B, sb, zb)], g.attrs(node))[0]
        if act is not None:
            v = OPS[act.op_type](self._ctx(act, 1), [v] + [g.consts.get(i) if i else None for i in act.input[1:]],
                                 g.attrs(act))[0]
        t = quant.quantize(v, ys, yz, yz.dtype)
        import torch
        self.lut, self.lut2 = torch.from_numpy(np.ascontiguousarray(t.reshape(-1))), None

    def run(self, ins, threads, want_extra=False):
        a, b = ins
        nin = bool(self.nhwc_in and all(self.nhwc_in))
        if not want_extra and nin == self.nhwc_out and a.shape == b.shape and (a.dtype, b.dtype) == self.dtypes:
            return {self.outputs[0]: self._lut2(a, b, threads)}  # what _run computes, no layout change
        from .layout import to_nchw, to_nhwc
        if nin and (ins[0].shape != ins[1].shape or want_extra):  # broadcasting is NCHW's
            nin, ins = False, [to_nchw(v) for v in ins]
        out = self._run(ins, threads, want_extra)
        if nin != self.nhwc_out:
            y = out[self.outputs[0]]
            out[self.outputs[0]] = to_nhwc(y) if self.nhwc_out else to_nchw(y)
        return out

    def _lut2(self, a, b, threads):
        """lut2_codes of equal-shape codes; the kernel and torch.from_numpy looked up once."""
        if self.lut2 is None:
            import torch
            from .build import kernels as lib
            self.lut2 = (lib().lut2_codes, torch.from_numpy)
        fn, t = self.lut2
        return fn(t(np.ascontiguousarray(a)), t(np.ascontiguousarray(b)), self.lut, self.base_a, self.base_b,
                  256, threads).numpy()

    def _run(self, ins, threads, want_extra):
        from .errors import NPUError
        a, b = ins
        if (a.dtype, b.dtype) != self.dtypes:
            raise NPUError(f"node {self.node_name!r}: input codes {a.dtype}, {b.dtype}, the zero "
                           f"points say {self.dtypes}")
        if a.shape != b.shape:
            try:
                a, b = np.broadcast_arrays(a, b)
            except ValueError as e:
                raise NPUError(f"node {self.node_name!r}: shapes {a.shape} and {b.shape}: {e}") from None
        out = {self.outputs[0]: self._lut2(a, b, threads)}
        if want_extra:
            vals = self._float_chain(dict(zip(self.inputs, ins)), threads)
            out.update({k: vals[k] for k in self.extra_outputs})
        return out


#: elementwise ops a 256-code table may absorb (each output element from the same input elements)
_ELEMENTWISE = {"Cast", "Sigmoid", "Tanh", "Erf", "Gelu", "HardSigmoid", "HardSwish", "Relu", "Clip", "LeakyRelu",
                "Elu", "Softplus", "Mish", "Exp", "Neg", "Abs", "Identity", "Add", "Sub", "Mul", "Div"}
_FLOAT_TO = {1, 10}  # Cast targets a chain may hold: FLOAT, FLOAT16


class UnaryCodes(_CodeStep):
    """``DQ(x) -> elementwise chain -> Q`` as one 256-entry table (module docstring)."""

    nhwc_in, nhwc_out = (), False

    def __init__(self, g, node, dq, chain, end, q):
        from .ops_float import OPS
        self.g, self.node, self.node_name = g, node, node.name
        # layout.py: elementwise, so any one layout -- offered only for the codes of a 2-D conv,
        # the one producer known to be rank 4 (the planner has no shapes; a transformer's
        # rank-3 codes must stay as they are)
        self.nhwc_capable = "all" if _from_conv2d(g, dq[0].input[0]) else False
        (dqn, xs, xz), (qn, ys, yz) = dq, q
        self.inputs, self.outputs = [dqn.input[0]], [qn.output[0]]
        self.extra_outputs = [n.output[0] for n in chain]
        self.absorbed = [n for n in chain if n is not node] + [qn]
        self.chain = [dqn] + chain
        self.x_dtype = xz.dtype
        codes, _ = _codes(xz.dtype)
        vals = {dqn.output[0]: quant.dequantize(codes, xs, xz)}
        for n in chain:
            args = [vals[i] if i in vals else g.consts.get(i) if i else None for i in n.input]
            vals[n.output[0]] = OPS[n.op_type](self._ctx(n, 1), args, g.attrs(n))[0]
        t = quant.quantize(np.asarray(vals[end.output[0]]).astype(np.float32), ys, yz, yz.dtype)
        self.table = np.empty(256, dtype=yz.dtype)  # indexed by the code's byte
        self.table[codes.view(np.uint8)] = t

    def run(self, ins, threads, want_extra=False):
        from .errors import NPUError
        from .layout import to_nchw, to_nhwc
        x, nin = ins[0], bool(self.nhwc_in and self.nhwc_in[0])
        if x.dtype != self.x_dtype:
            raise NPUError(f"node {self.node_name!r}: input codes {x.dtype}, the zero point says {self.x_dtype}")
        if want_extra and nin:
            x, nin = to_nchw(x), False
        y = np.take(self.table, np.ascontiguousarray(x).view(np.uint8))
        if nin != self.nhwc_out:
            y = to_nhwc(y) if self.nhwc_out else to_nchw(y)
        out = {self.outputs[0]: y}
        if want_extra:
            vals = self._float_chain({self.inputs[0]: x}, threads)
            out.update({k: vals[k] for k in self.extra_outputs})
        return out


_RANK_KEEPING = {"QuantizeLinear", "DequantizeLinear", "Relu", "Clip", "Add", "MaxPool"}


def _from_conv2d(g, name, depth: int = 6) -> bool:
    """``name`` is computed from a Conv with a rank-4 weight through rank-keeping nodes (its
    quantizers, bias Add, Relu / Clip, MaxPool): a rank-4 tensor."""
    n = g.producer(name)
    for _ in range(depth):
        if n is None:
            return False
        if n.op_type == "Conv":
            w = g.producer(n.input[1])
            w = g.const(w.input[0]) if w is not None and w.op_type == "DequantizeLinear" else g.const(n.input[1])
            return w is not None and np.asarray(w).ndim == 4
        if n.op_type not in _RANK_KEEPING:
            return False
        n = g.producer(n.input[0])
    return False


def _unary_chain(g, node):
    """(dq params, chain nodes in dependency order, its end node, q params of each reader) for an
    elementwise chain rooted at ``node``, or None (module docstring)."""
    firsts = [i for i in node.input if i and g.const(i) is None]
    if len(firsts) != 1 or node.op_type not in _ELEMENTWISE:
        return None
    dq = _dq_params(g, firsts[0])
    if dq is None:
        return None
    # a node joins once every input is the DQ output, a chain tensor or a scalar constant, so
    # the chain list is in dependency order; a reader still waiting at the end is outside
    known, chain, seen, waiting, todo = {firsts[0]}, [], set(), {}, [node]
    while todo:
        n = todo.pop()
        if id(n) in seen or n.op_type == "QuantizeLinear":
            continue
        ok = _elementwise(g, n, known)
        if ok is None:
            waiting[id(n)] = n
            continue
        if not ok:
            return None
        waiting.pop(id(n), None)
        seen.add(id(n))
        chain.append(n)
        known.add(n.output[0])
        todo += list(g.consumers(n.output[0])) + list(waiting.values())
    return _chain_end(g, dq, chain)


def _elementwise(g, n, known):
    """True: ``n`` joins the chain; None: an input is not known yet; False: it cannot join."""
    if n.op_type not in _ELEMENTWISE or n.domain not in ("", "ai.onnx") or len(n.output) != 1:
        return False
    if n.op_type == "Cast" and g.attrs(n).get("to") not in _FLOAT_TO:
        return False
    pending = False
    for i in n.input:
        if not i or i in known:
            continue
        c = g.const(i)
        if c is None:
            pending = True
        elif np.asarray(c).size != 1 or np.asarray(c).dtype.kind != "f":
            return False  # a per-channel constant makes the element depend on its position
    return None if pending else True


def _chain_end(g, dq, chain):
    """``(dq, chain, end, q readers)`` when exactly one chain tensor leaves the chain, read only
    by QuantizeLinear nodes, and none is a graph output; else None. The DQ output may have other
    readers: its DequantizeLinear still runs for them."""
    inside = {id(n) for n in chain}
    ends = [n for n in chain if n.output[0] in g.outputs or not g.consumers(n.output[0])
            or not all(id(r) in inside for r in g.consumers(n.output[0]))]
    if len(ends) != 1 or ends[0].output[0] in g.outputs:
        return None
    qs = _quantizers_of(g, ends[0].output[0])
    return (dq, chain, ends[0], qs) if qs else None


def match(g, node):
    """The code step rooted at ``node`` (MaxPool, a binary op, or the first node of an elementwise
    chain on codes): one step, a list of steps (read by several quantizers, one step each), or None."""
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "GlobalAveragePool" and len(node.input) == 1:  # gap_codes.py
        from .gap_codes import GapCodes
        dq, q = _dq_params(g, node.input[0]), _q_after(g, node.output[0])
        return GapCodes(g, node, dq, q) if dq is not None and q is not None else None
    if node.op_type in ("Flatten", "Reshape") and node.input:  # shape_codes.py
        from .shape_codes import match as match_shape
        return match_shape(g, node, _dq_params(g, node.input[0]), _q_after(g, node.output[0]))
    if node.op_type in ("ScatterElements", "ScatterND"):  # ops_scatter.py: the scatter-add group
        from .ops_scatter import match as match_scatter
        return match_scatter(g, node)
    if node.op_type == "MaxPool":
        if len(node.output) > 1 and node.output[1]:
            return None
        dq, q = _dq_params(g, node.input[0]), _q_after(g, node.output[0])
        if dq is None or q is None:
            return None
        return MaxPoolCodes(g, node, dq, q)
    dqa = dqb = None
    if node.op_type in _BINARY and len(node.input) == 2:
        dqa, dqb = _dq_params(g, node.input[0]), _dq_params(g, node.input[1])
    if dqa is not None and dqb is not None:
        act, nxt = None, node.output[0]
        c = g.sole_consumer(nxt)
        if c is not None and c.op_type in ("Relu", "Clip"):
            if c.op_type == "Clip" and (g.opset < 11 or any(i and g.const(i) is None for i in c.input[1:])):
                return None
            act, nxt = c, c.output[0]
        qs = _quantizers_of(g, nxt)
        if not qs:
            return None
        steps = [BinaryCodes(g, node, dqa, dqb, act, q) for q in qs]
        return steps[0] if len(steps) == 1 else steps
    found = _unary_chain(g, node)
    if found is None:
        return None
    dq, chain, end, qs = found
    steps = [UnaryCodes(g, node, dq, chain, end, q) for q in qs]
    return steps[0] if len(steps) == 1 else steps


def _quantizers_of(g, name):
    """The QuantizeLinear readers of ``name`` (each with scalar 8-bit parameters) when they are
    all its readers and ``name`` is not a graph output, else ``[]``. A residual block's sum feeds
    the next conv's input quantizer and the next sum's: one code step per reader, each its own
    table -- the float value is never needed, so none is computed."""
    readers = g.consumers(name)
    if not readers or name in g.outputs:
        return []
    if len(readers) == 1:
        q = _q_after(g, name)
        return [q] if q is not None else []
    qs = [_q_params(g, n) for n in readers]
    return qs if all(q is not None for q in qs) else []
