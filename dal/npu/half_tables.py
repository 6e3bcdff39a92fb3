"""Float16 tables inside float chains: after a Cast to float16, a run of element-wise members whose
only non-constant input is that float16 tensor is a function of its 16 bits, so it is looked up.

An FP16 island's SiLU (fused_chains.py's chain ``Cast16 -> Cast32 -> Sigmoid -> Mul -> Cast16 ->
Cast32``, the Mul reading the Cast32 and the Sigmoid) computes, for each element, a value that
depends on that element's float16 bit pattern h alone: every member after the Cast to float16 is
element-wise (Cast, Add, Sub, Mul, Div, Pow, Sqrt, Neg, Sigmoid) and its other inputs are scalar
constants (of rank 0 or 1: they broadcast to the key's shape). So each tensor of the run that is read after it is ``T[h]``, with ``T`` the run's own
member functions applied at load to all 65,536 float16 patterns:

    y = T[x16.view(uint16)]          T = run(arange(65536, uint16).view(float16))

Contract: the same bits as running the members (NaN payloads included), because T is computed by
those very functions. Their one size-dependent path, the float32 <-> float16 Cast (torch's
conversion from 4096 elements on, numpy's below: the same values, NaN payloads aside), is honoured
with two tables: one computed on the whole pattern array (the torch path), one in pieces of 2048
elements (numpy's), the lookup choosing by the tensor's size as the Cast would. Only a run of at
least ``_MEMBERS_PER_LOOKUP`` members per tensor it hands on is looked up (a Cast16 -> Cast32 round
trip costs what a lookup does); a non-scalar constant input ends a run; a run whose members raise
on the patterns keeps its members. A key that is not a float16 tensor of rank >= 1 makes the
lookup raise, and the chain then runs its members one by one (fused_chains.ChainStep.run).
"""
from __future__ import annotations

import numpy as np

#: element-wise member op types (fused_chains.FUSABLE's element-wise ones)
ELEMENTWISE = frozenset({"Cast", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Neg", "Sigmoid"})
_CAST_AT = 4096  # ops_float's Cast and fused_chains' cast take torch's conversion from this size on
_PIECE = 2048    # below _CAST_AT: the table of numpy's path
_F16 = np.dtype(np.float16)
#: a lookup (np.take of a 65,536-entry table: ~2.5 ns an element, 128 x 768 elements ~240 us; the
#: C++ gather csrc/lut16.cpp for float32 tables of 4096 elements or more, measured below) costs
#: about what three cheap element-wise members do (a Cast ~45 us, a Mul ~15 us; a Sigmoid ~650 us):
#: a run is looked up only when it holds at least this many members per table it must export
_MEMBERS_PER_LOOKUP = 3


def _is_cast16(part) -> bool:
    if part.node.op_type != "Cast":
        return False
    to = [a.i for a in part.node.attribute if a.name == "to"]
    return to == [10]  # TensorProto.FLOAT16


def _run(ops, head, x, vals):
    """The run's member functions on float16 ``x`` as the head slot; {slot: value}."""
    env = dict(vals)
    env[head] = x
    for fn, args, out in ops:
        env[out] = fn([env[j] for j in args])
    return env


def _gather():
    """``(lut16, torch.from_numpy)`` of the C++ library (csrc/lut16.cpp), or None without a build."""
    from .build import BuildError, kernels
    try:
        import torch
        return kernels().lut16, torch.from_numpy
    except BuildError:
        return None


def _lookup(small, large, gather):
    if gather is not None:
        lut16, from_numpy = gather
        large_t = from_numpy(large)

    def lookup(ins):
        h = ins[0]
        if h.dtype != _F16 or h.ndim < 1:
            raise TypeError("the table's key is not a float16 tensor")  # the chain runs its members
        if h.size < _CAST_AT:
            return np.take(small, h.view(np.uint16))
        if gather is None:
            return np.take(large, h.view(np.uint16))
        return lut16(from_numpy(np.ascontiguousarray(h)), large_t).numpy()  # the same entries, ~3x np.take
    return lookup


def _tabulate(step) -> int:
    """Replace each run of ``step``'s program (module doc) by its lookups; the number of runs."""
    prog = step.program
    ops, parts = list(prog["ops"]), step.parts
    if len(ops) != len(parts):
        return 0
    scalar = {}  # const input slot -> its value, when a scalar
    for k, name in enumerate(step.inputs):
        if name and prog["const"].get(name, False):
            v = np.asarray(prog["consts"].get(name))
            if v.size == 1 and v.ndim <= 1:  # broadcasts to the key's shape, whatever its rank >= 1
                scalar[k] = v
    read_after = lambda j: {a for _, args, _ in ops[j:] for a in args} | {s for _, s in prog["out"]}
    new, i, runs = [], 0, 0
    while i < len(ops):
        new.append(ops[i])
        if not _is_cast16(parts[i]):
            i += 1
            continue
        head, known, j = ops[i][2], {ops[i][2]}, i + 1
        while (j < len(ops) and parts[j].node.op_type in ELEMENTWISE
               and all(a in known or a in scalar for a in ops[j][1])):
            known.add(ops[j][2])
            j += 1
        run = ops[i + 1:j]
        exports = sorted(s for s in known - {head} if s in read_after(j))
        if not exports or len(run) < _MEMBERS_PER_LOOKUP * len(exports):
            i += 1
            continue
        keys = np.arange(65536, dtype=np.uint16).view(np.float16)
        try:
            with np.errstate(all="ignore"):
                large = _run(run, head, keys, scalar)
                pieces = [_run(run, head, keys[p:p + _PIECE], scalar) for p in range(0, 65536, _PIECE)]
            tables = []
            for s in exports:
                small = np.concatenate([np.asarray(e[s]) for e in pieces])
                if large[s].shape != keys.shape or small.shape != keys.shape or small.dtype != large[s].dtype:
                    raise ValueError("not element-wise")
                tables.append((s, small, np.asarray(large[s])))
        except Exception:
            i += 1
            continue
        gather = _gather() if all(t.dtype == np.float32 for _, _, t in tables) else None
        new.extend((_lookup(small, large, gather), (head,), s) for s, small, large in tables)
        runs += 1
        i = j
    if runs:
        prog["ops"] = new
    return runs


def tabulate(steps) -> int:
    """Apply the module doc to every fused_chains.ChainStep of ``steps`` (in place); the number of
    runs replaced by lookups."""
    from .fused_chains import ChainStep
    return sum(_tabulate(st) for st in steps if type(st) is ChainStep)
