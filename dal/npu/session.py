"""Session: parse an ONNX model once, pack its weights once, run it many times.

    sess = dal.npu.load("model.onnx", semantics="integer")
    outputs = sess.run({"input": x})                        # list in graph-output order
    outputs, values = sess.run({"input": x}, return_intermediates=True)

semantics:
  "integer" (default): DQ -> Conv/Gemm/MatMul [-> Relu/Clip] -> Q groups run as exact int32
      kernels + requantizer (integer_groups.py; what the NPU computes). Everything else node by node.
  "onnx": every node by itself with ONNX float semantics (float32 dequantized values,
      float64-accumulated conv/gemm rounded once to float32, Q): the graph's own arithmetic,
      independent of summation order. The fixed-point requantizer does not apply.

fuse_chains=True (default; "integer" semantics): requantized data movement as code tables
(code_moves.py) and connected float nodes as one step each (fused_chains.py), bit-identical to
the nodes one by one (fuse_chains=False); every-tensor, layerwise and teacher-forced runs run
them one by one.
"""
from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

from . import layout
from .errors import NPUError, UnsupportedNode
from .graph import Graph, load_model
from .metadata import read_requantizer, read_sparse24
from .ranks import rank4_names
from .dispatch import NAMES as dispatch_names, resolve as resolve_kernel
from .torch_threads import torch_threads
from .validate import check_claimed_types, check_quant_nodes, precheck


def named(e: NPUError, node) -> NPUError:
    """``e`` with its message prefixed by the node's name and op type, unless it names it
    (or a fused chain's member step already named it: ``e.node_named``)."""
    if not getattr(e, "node_named", False) and f"{node.name!r}" not in str(e):
        e.args = (f"node {node.name!r} ({node.op_type}): {e}",) + tuple(e.args[1:])
    return e


def run_member(step, ins, threads) -> dict:
    """``step.run(ins, threads)`` for a member of a fused step run one by one: an NPUError it
    raises names the member's node (:func:`named`) and is marked so the fused step adds nothing."""
    try:
        return step.run(ins, threads)
    except NPUError as e:
        e.node_named = True
        raise named(e, step.node)


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off inside the block, back on afterwards only if it was
    on (never left changed). A session run makes no reference cycles; a full collection would
    walk every live torch object, milliseconds in the middle of a run."""
    was_on = gc.isenabled()
    if was_on:
        gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class NodeStep:
    kind = "node"

    def __init__(self, g, node, fn):
        self.node, self.node_name, self.fn, self.g = node, node.name, fn, g
        self.inputs = list(node.input)
        self.outputs = list(node.output)
        self.extra_outputs, self.ctx = [], {}

    def run(self, ins, threads, want_extra=False):
        ctx = self.ctx.get(threads)  # per thread count, once: no op writes to its context
        if ctx is None:
            ctx = self.ctx[threads] = SimpleNamespace(node=self.node, opset=self.g.opset, threads=threads)
        attrs = self.g.attrs(self.node)
        precheck(self.node, ins, attrs)
        outs = self.fn(ctx, ins, attrs)
        return {name: np.asarray(v) for name, v in zip(self.outputs, outs) if name}


def _with_isa(step, isa):
    """``step``, told the session's kernel variant where it has a C++ quantizer of its own
    (gap_codes.GapCodes: quantize_codes), so that a forced variant holds for it too."""
    if hasattr(step, "isa"):
        step.isa = isa
    return step


def _default_threads():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


class Session:
    """A parsed model. ``run`` is re-entrant for different inputs (weights are read-only)."""

    def __init__(self, model, *, semantics: str = "integer", threads: int | None = None,
                 kernel: str | None = None, fuse_chains: bool = True):
        if semantics not in ("integer", "onnx"):
            raise NPUError(f"semantics must be 'integer' or 'onnx', got {semantics!r}")
        from .op_table import kernels
        node_kernels = kernels()  # every ops_* module's kernels (op_table.py)
        from .fused_codes import match as match_codes
        from .integer_groups import match
        from .group_post import group_step
        from .quant_step import match as match_quant, match_dequant
        self.model = load_model(model)
        self.semantics, self.fuse_chains = semantics, bool(fuse_chains) and semantics == "integer"
        # kernel variant (dispatch.py): None = the best this CPU's cpuid allows
        self.isa = resolve_kernel(kernel) if semantics == "integer" else -1
        self.kernel = dispatch_names[self.isa] if self.isa >= 0 else None
        self.threads = threads or _default_threads()
        g = self.graph = Graph(self.model)
        check_claimed_types(g)
        check_quant_nodes(g)
        self.requantizer = read_requantizer(self.model)
        self.sparse24 = read_sparse24(self.model)
        for name in self.sparse24:
            if name not in g.consts:
                raise NPUError(f"dal.sparse_24 names {name!r}, which is not an initializer")
        steps, absorbed, pending = [], set(), {}
        for n in g.nodes:
            if id(n) in pending:  # a group with a pass-through runs where that node is (group_post.py)
                steps.append(pending.pop(id(n)))
            if id(n) in absorbed:
                continue
            if n.domain not in ("", "ai.onnx"):
                raise UnsupportedNode(n, self._in_types(n), f"domain {n.domain!r}")
            plan = None
            if semantics == "integer":
                try:
                    plan = match(g, n, self.sparse24)
                except NPUError as e:
                    raise named(e, n)
                except Exception as e:
                    raise NPUError(f"node {n.name!r} ({n.op_type}): {type(e).__name__}: {e}") from None
            if plan is not None:  # a list: one plan per quantizer reading the group (fan_out.py)
                plans = plan if isinstance(plan, list) else [plan]
                for p in plans:
                    p["isa"] = self.isa
                plan = plans[0]
                step = group_step(g, n, plans, self.requantizer, self.threads)
                if plan.get("post") is not None:  # its Resize may read sizes computed after n
                    pending[id(plan["post"])] = step
                else:
                    steps.append(step)
                for o in [plan["op_out"], plan["act_out"], plan.get("post_out")]:
                    if o:
                        absorbed.update(id(c) for c in g.consumers(o))
                continue
            if semantics == "integer":
                try:
                    cstep = match_codes(g, n)
                except Exception:  # unusual attributes: the node-by-node path reports them
                    cstep = None
                for one in (cstep if isinstance(cstep, list) else [cstep] if cstep is not None else []):
                    steps.append(_with_isa(one, self.isa))
                    absorbed.update(id(c) for c in one.absorbed)
                if cstep is not None:
                    continue
            fn = node_kernels.get(n.op_type)
            if fn is None:
                raise UnsupportedNode(n, self._in_types(n), "no implementation for this op type")
            node_step = NodeStep(g, n, fn)
            qstep = (match_quant(g, n, node_step, self.isa) or match_dequant(g, n, node_step)
                     if semantics == "integer" else None)
            steps.append(qstep or node_step)
        if semantics == "onnx":
            for name in self.sparse24:  # still verified, even though the float path runs
                from .sparse import check_24
                check_24(g.consts[name], self.sparse24[name] if True else 0, name)
        self._finish(steps)

    def _finish(self, steps):
        """Set ``steps`` (less the constant ones, run here once: constant_steps.py), their
        liveness and the pixel-major plan."""
        from .constant_steps import fold
        g, self.steps, self._folded = self.graph, steps, {}
        self._live = self._liveness()
        self.steps, self._folded = fold(steps, self._live, g.consts,
                                        lambda st, ins: self._exec(st, ins, False))
        from .const_matmul import cache_weights  # a constant weight's float64 copy, made once
        self.steps = cache_weights(self.steps, {**g.consts, **self._folded})
        self._live = self._liveness()
        # tensors kept pixel-major between integer steps (layout.py); every one handed out is NCHW
        self._nhwc = (layout.plan(self.steps, self._live, g.outputs, rank4_names(g))
                      if self.semantics == "integer" else set())
        self._plain = self.steps  # what every-tensor runs use: each node's output kept, forcible
        if self.fuse_chains:  # requantized moves as one table (code_moves.py), then float chains (fused_chains.py)
            from .code_moves import fuse as fuse_moves, fuse_concat
            from .fused_chains import fuse
            consts = {**g.consts, **self._folded}
            self.steps = fuse_moves(self.steps, self._live, g, consts, g.outputs, self._nhwc)
            self._live = self._liveness()
            self.steps = fuse_concat(self.steps, self._live, consts, g.outputs, self._nhwc)
            self._live = self._liveness()
            self.steps = fuse(self.steps, self._live, g, consts, g.outputs, self._nhwc)
            self._live = self._liveness()
            from .half_tables import tabulate
            tabulate(self.steps)  # element-wise runs after a Cast to float16 as 65,536-entry tables

    def _in_types(self, n):
        out = []
        for i in n.input:
            if i in self.graph.consts:
                out.append(str(self.graph.consts[i].dtype))
            elif i in self.graph.input_info:
                from onnx import TensorProto
                out.append(TensorProto.DataType.Name(self.graph.input_info[i].type.tensor_type.elem_type).lower())
            else:
                out.append("?" if i else "none")
        return out

    def _liveness(self):
        need = set(self.graph.outputs)
        live = [False] * len(self.steps)
        for k in range(len(self.steps) - 1, -1, -1):
            s = self.steps[k]
            if any(o in need for o in s.outputs):
                live[k] = True
                need.update(i for i in s.inputs if i)
        return live

    @property
    def input_names(self):
        return list(self.graph.inputs)

    def _feed(self, inputs):
        g = self.graph
        if isinstance(inputs, dict):
            unknown = set(inputs) - set(g.inputs)
            if unknown:
                raise NPUError(f"unknown graph inputs {sorted(unknown)}; the graph takes {g.inputs}")
            feed = dict(inputs)
        else:
            inputs = list(inputs)
            if len(inputs) != len(g.inputs):
                raise NPUError(f"{len(inputs)} inputs given, the graph takes {len(g.inputs)}: {g.inputs}")
            feed = dict(zip(g.inputs, inputs))
        from .tensors import np_dtype
        env = {}
        for name in g.inputs:
            if name not in feed:
                raise NPUError(f"graph input {name!r} is missing")
            x = feed[name]
            if type(x).__name__ == "TensorProto":
                from .tensors import load_initializer
                x = load_initializer(x)
            x = np.asarray(x)
            tt = g.input_info[name].type.tensor_type
            want = np_dtype(tt.elem_type) if tt.elem_type else x.dtype
            if x.dtype != want:
                raise NPUError(f"graph input {name!r} must be {want}, got {x.dtype}")
            if tt.HasField("shape"):
                dims = tt.shape.dim
                if len(dims) != x.ndim or any(d.HasField("dim_value") and d.dim_value != s
                                              for d, s in zip(dims, x.shape)):
                    want_s = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in dims]
                    raise NPUError(f"graph input {name!r} must have shape {want_s}, got {list(x.shape)}")
            env[name] = x
        env.update(self._folded)  # values of the constant steps run at load (constant_steps.py)
        return env

    def _exec(self, step, ins, want_extra):
        try:
            return step.run(ins, self.threads, want_extra)
        except NPUError as e:
            raise named(e, step.node)
        except Exception as e:  # numpy / torch / C++ (TORCH_CHECK) errors -> named ValueError
            raise NPUError(f"node {step.node_name!r} ({step.node.op_type}) failed: "
                           f"{type(e).__name__}: {e}") from None

    def _ins(self, step, env, nchw):
        """The step's input values from ``env`` (in the session's layout), each converted to NCHW
        where the step does not read it pixel-major (converted once per run: ``nchw`` caches)."""
        consts, takes = self.graph.consts, getattr(step, "nhwc_in", ()) or ()
        ins = []
        for k, i in enumerate(step.inputs):
            v = None if not i else env[i] if i in env else consts[i]
            if i in self._nhwc and not (k < len(takes) and takes[k]):
                if i not in nchw:
                    nchw[i] = layout.to_nchw(v)
                v = nchw[i]
            ins.append(v)
        return ins

    def _public(self, values: dict) -> dict:
        """``values`` with every pixel-major tensor turned NCHW."""
        return {k: layout.to_nchw(v) if k in self._nhwc else v for k, v in values.items()}

    def _fetch_plan(self, every: bool):
        """Per step to run (every step, or the live ones), built once per session: (step, fetch,
        drop), fetch = ((name, how), ...) with how 0: absent input (None), 1: the value as held,
        2: NCHW of a pixel-major value (the step does not read it pixel-major), the same
        decisions as ``_ins`` taken once instead of per run; drop: the tensors no later live
        step reads (none of them a graph input, output or constant; none when ``every``)."""
        key = "_plan_all" if every else "_plan_live"
        plan = self.__dict__.get(key)
        if plan is None:
            plan, last = [], {}
            steps = self._plain if every else self.steps  # unfused when every tensor is wanted
            for step, live in zip(steps, self._live if not every else [True] * len(steps)):
                if not (live or every):
                    continue
                takes = getattr(step, "nhwc_in", ()) or ()
                plan.append((step, tuple((i, 0 if not i else 2 if i in self._nhwc and not (k < len(takes) and takes[k])
                                          else 1) for k, i in enumerate(step.inputs)), []))
                last.update((i, len(plan) - 1) for i in step.inputs if i)
            if not every:  # drop each tensor after its last reader: its buffer is reused while hot
                keep = set(self.graph.outputs) | set(self.graph.inputs) | set(self.graph.consts)
                for name, k in last.items():
                    if name not in keep:
                        plan[k][2].append(name)
            self.__dict__[key] = plan
        return plan

    def _steps_on(self, env, every, want_extra, timer=None):
        """Run the planned steps on ``env`` (updated in place); ``timer(k, seconds)`` per step."""
        consts, nchw, exe = self.graph.consts, {}, self._exec
        clock = time.perf_counter
        for k, (step, fetch, drop) in enumerate(self._fetch_plan(every)):
            t0 = clock() if timer else 0.0  # a layout conversion counts to the step that needs it
            ins = []
            for i, how in fetch:
                if how == 1:  # the common case first: the value as held
                    ins.append(env[i] if i in env else consts[i])
                elif how:
                    if i not in nchw:
                        nchw[i] = layout.to_nchw(env[i] if i in env else consts[i])
                    ins.append(nchw[i])
                else:
                    ins.append(None)
            env.update(exe(step, ins, want_extra))
            del ins
            for i in drop:
                env.pop(i, None)
            if nchw:  # usually empty: a pixel-major tensor read NCHW somewhere
                for i in drop:
                    nchw.pop(i, None)
            if timer:
                timer(k, clock() - t0)
        return env

    def run(self, inputs, *, return_intermediates: bool = False):
        """Outputs (list, graph-output order); with return_intermediates also a dict of every
        tensor the graph names (inputs, constants excluded) with the value it holds.

        Python's cyclic garbage collector is paused for the run (a run makes no reference
        cycles; a full collection would walk every torch object) and restored in ``finally``
        if the caller had it on; torch's intra-op thread count is the session's ``threads``
        for the run and restored after (torch_threads.py: a torch call inside a step never
        uses more threads than the session was given)."""
        with gc_paused(), torch_threads(self.threads):
            env = self._steps_on(self._feed(inputs), return_intermediates, return_intermediates)
        consts = self.graph.consts
        outs = [env[o] if o in env else consts[o] for o in self.graph.outputs]
        if return_intermediates:
            values = self._public({k: v for k, v in env.items() if k not in self.graph.inputs})
            return outs, values
        return outs

    def profile(self, inputs, *, repeat: int = 5) -> list[dict]:
        """Where the time goes: each step's median wall time over ``repeat`` runs of ``inputs``,
        slowest first, as dicts {node, op, kind ("fused" integer group, "codes" table/pool
        group or requantized moves, "blocked_float" blocked linear with a float output, "chain"
        connected float nodes run as one step (op "FloatChain"), "node"), ms, share (of the sum)}. The steps run exactly as in ``run``."""
        plan = self._fetch_plan(False)
        times = [[] for _ in plan]
        with gc_paused(), torch_threads(self.threads):  # as in run
            for _ in range(max(1, repeat)):
                self._steps_on(self._feed(inputs), False, False, lambda k, t: times[k].append(t))
        rows = [{"node": st.node_name, "op": st.node.op_type, "kind": st.kind,
                 "ms": float(np.median(t)) * 1e3} for (st, _, _), t in zip(plan, times) if t]
        total = sum(r["ms"] for r in rows) or 1.0
        for r in rows:
            r["share"] = r["ms"] / total
        return sorted(rows, key=lambda r: -r["ms"])

    def run_layerwise(self, values: dict) -> dict:
        """Run every step on the given tensor values (e.g. an oracle's intermediates) instead of
        its own upstream results; returns what each step computes. Isolates per-layer parity."""
        with torch_threads(self.threads):
            return self._layerwise(values)

    def _layerwise(self, values: dict) -> dict:
        out = self._public(dict(self._folded))
        consts = {**self.graph.consts, **self._folded}
        for step in self._plain:
            try:
                ins = [None if not i else values[i] if i in values else consts[i] for i in step.inputs]
            except KeyError:
                continue
            takes = getattr(step, "nhwc_in", ()) or ()
            ins = [layout.to_nhwc(v) if k < len(takes) and takes[k] else v for k, v in enumerate(ins)]
            out.update(self._public(self._exec(step, ins, True)))
        return out

    def run_teacher_forced(self, inputs, reference: dict) -> dict:
        """Run the graph, replacing each step's outputs that ``reference`` holds (e.g. an
        oracle's integer tensors) by the reference values before later steps read them; return
        every value this session computed itself. Forcing the quantized tensors only makes each
        row "one layer from the same quantized inputs": the layer's own float arithmetic still
        runs here, and a near-tie flip upstream cannot cascade into it."""
        with torch_threads(self.threads):
            return self._teacher_forced(inputs, reference)

    def _teacher_forced(self, inputs, reference: dict) -> dict:
        env, own = self._feed(inputs), {}
        for step in self._plain:
            out = self._exec(step, self._ins(step, env, {}), True)
            own.update(self._public(out))
            env.update({k: (layout.to_nhwc(reference[k]) if k in self._nhwc else reference[k])
                        if k in reference else v for k, v in out.items()})
        return own


def load(model, *, semantics: str = "integer", threads: int | None = None,
         kernel: str | None = None, fuse_chains: bool = True) -> Session:
    """Parse ``model`` (path, bytes or onnx.ModelProto) once; see Session. ``kernel`` forces a
    kernel variant ("portable", "avx2", "avx_vnni", "avx512_vnni", "amx_int8"; None: the best this CPU runs,
    see dal.npu.info()); every variant gives the same exact results. ``fuse_chains`` (default
    True, "integer" semantics): requantized moves as code tables (code_moves.py) and connected
    float nodes as one step each (fused_chains.py), bit-identical to running them node by node
    (False)."""
    return Session(model, semantics=semantics, threads=threads, kernel=kernel, fuse_chains=fuse_chains)


def run(model, inputs, *, return_intermediates: bool = False, threads: int | None = None,
        semantics: str = "integer"):
    """One-shot ``load(model).run(inputs)``; list of outputs (plus dict of intermediates)."""
    return load(model, semantics=semantics, threads=threads).run(
        inputs, return_intermediates=return_intermediates)
