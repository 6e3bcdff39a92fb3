"""Pixel-major activations between integer steps (a layout, never a change of any value).

A 4-D code tensor that flows only between steps able to read and write it pixel-major
([N, H, W, C]: each pixel's channels contiguous) is kept that way: fused convs read it as the
rows of their GEMM (a 1x1 conv is then a plain GEMM on it, a kxk conv reads it in place) and
write their output rows contiguously, MaxPool takes channel-wise maxima of whole pixels, and
the elementwise code tables do not care about the order. Everything else sees NCHW: the
session converts a pixel-major tensor when a step that does not take it reads it, and every
tensor it hands out (outputs, ``return_intermediates``, ``run_layerwise``) is NCHW. A graph
output is never pixel-major.

Steps say what they can do: ``nhwc_capable`` (True: reads input 0 and writes output 0 in
either layout; "all": reads all inputs together in either layout, as elementwise tables do;
"out": writes output 0 in either layout, reads NCHW; absent or False: NCHW only). ``plan`` sets ``nhwc_in`` (a tuple, per input) and ``nhwc_out``
on every capable step and returns the set of tensor names stored pixel-major.

Only tensors of rank 4 that a 2-D convolution reads or writes, directly or through other
pixel-major steps, are planned: ``rank4`` (ranks.py) holds the names proven of rank 4 from the
file, and a connected set of pixel-major tensors with no convolution step in it is dropped whole
(nothing would gain from the reordering). Other ranks -- a transformer's [N, tokens, C], the
rank-1 codes of an MLP -- pass through as they are.
"""
from __future__ import annotations

import numpy as np


def to_nchw(x: np.ndarray) -> np.ndarray:
    """[N, H, W, C] -> [N, C, H, W], contiguous."""
    return np.ascontiguousarray(np.moveaxis(x, 3, 1))


def to_nhwc(x: np.ndarray) -> np.ndarray:
    """[N, C, H, W] -> [N, H, W, C], contiguous."""
    return np.ascontiguousarray(np.moveaxis(x, 1, 3))


def plan(steps, live, graph_outputs, rank4=None) -> set:
    """Names of the tensors stored pixel-major: of rank 4 (in ``rank4``; None: every step output,
    for graphs of convolutions only), produced (output 0) by a capable live step, not a graph
    output, and read by live steps that all take it so ("all" steps only when every one of their
    inputs is pixel-major). The largest such set, by removing violations until none is left; then
    each connected part (tensors joined by a step that reads or writes both pixel-major) with no
    2-D convolution step in it is dropped."""
    live_steps = [s for s, ok in zip(steps, live) if ok]
    cap = lambda s: getattr(s, "nhwc_capable", False)
    S = {s.outputs[0] for s in live_steps if cap(s) and s.outputs and s.outputs[0]} - set(graph_outputs)
    if rank4 is not None:
        S &= set(rank4)
    changed = True
    while changed:
        changed = False
        for s in live_steps:
            ins = [i for i in s.inputs if i]
            if cap(s) == "all":
                ok = bool(ins) and all(i in S for i in ins)
                drop = [] if ok else [i for i in ins if i in S] + ([s.outputs[0]] if s.outputs[0] in S else [])
            elif cap(s) is True:
                drop = [i for i in ins[1:] if i in S]  # only input 0 is read pixel-major
            else:
                drop = [i for i in ins if i in S]
            for name in drop:
                S.discard(name)
                changed = True
    S -= _without_conv(live_steps, S, cap)
    for s in steps:
        if cap(s):
            on = s in live_steps
            s.nhwc_in = tuple(on and bool(i) and i in S and (cap(s) == "all" or (cap(s) is True and k == 0))
                              for k, i in enumerate(s.inputs))
            s.nhwc_out = on and s.outputs[0] in S
    return S


def _is_conv(step) -> bool:
    """A step of the fused 2-D convolution kernel (integer_groups.FusedStep / fan_out)."""
    return getattr(step, "kind", "") == "fused" and getattr(step, "op", None) == "Conv"


def _without_conv(live_steps, S, cap) -> set:
    """The names of S in connected parts (union of the pixel-major tensors each step reads or
    writes) that hold no convolution step. Dropping a whole part keeps every step's constraint:
    a step's pixel-major tensors all lie in one part."""
    parent = {n: n for n in S}

    def root(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    touched = []  # (step, one of its pixel-major tensors)
    for s in live_steps:
        mine = [i for i in s.inputs if i and i in S] + [o for o in s.outputs[:1] if o in S] if cap(s) else []
        for n in mine[1:]:
            parent[root(n)] = root(mine[0])
        if mine:
            touched.append((s, mine[0]))
    conv_roots = {root(n) for s, n in touched if _is_conv(s)}
    return {n for n in S if root(n) not in conv_roots}
