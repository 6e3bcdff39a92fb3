"""Searched layers the hardware makes share one activation format: those feeding one op it runs
without requantizing (``shared_scale: [cat, ...]`` in the hardware model, see
``dal.prepare.shared_scale``).

Found on the base prepared model in one forward with autograd on: every functional QAT op whose
``op_class`` the hardware lists in ``shared_scale`` records the autograd nodes of its inputs; from
each, the graph is walked back (through ReLU, pooling, fake quantizers, ...) to the outputs of the
searched layers that produced it. The walk stops at a searched layer's output (a member), and at
the output of any other layer with its own output quantizer that is not itself a shared-scale op
(it requantizes, so the format there is its own, not the searched layer's).
"""
from __future__ import annotations

import torch


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def _producers(node, stops: dict, seen: set) -> set:
    """Names of the searched layers whose output reaches autograd ``node`` (iterative walk)."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if id(n) in stops:
            if stops[id(n)] is not None:
                found.add(stops[id(n)])
            continue
        stack.extend(nxt for nxt, _ in getattr(n, "next_functions", ()))
    return found


def shared_scale_groups(prepared_model, example_inputs, names, op_classes) -> list:
    """Lists of searched layer paths (``names``) whose outputs feed one op of ``op_classes``
    in ``prepared_model``; each list must take one activation format. Empty when the hardware
    has no ``shared_scale`` op classes."""
    wanted = set(op_classes or ())
    if not wanted:
        return []
    names = set(names)
    stops: dict = {}     # id(autograd node) -> searched layer name, or None for a requantizing barrier
    keep: list = []      # the nodes themselves, so their ids stay unique during the forward
    feeds: list = []     # per shared-scale op call: the autograd nodes of its inputs
    handles = []

    def record(name):
        def hook(mod, args, out):
            for t in _tensors((out,)):
                if t.grad_fn is not None:
                    stops.setdefault(id(t.grad_fn), name)  # inner module first: a container does not override
                    keep.append(t.grad_fn)
        return hook

    for path, mod in prepared_model.named_modules():
        shared = getattr(mod, "op_class", None) in wanted
        if path in names:
            handles.append(mod.register_forward_hook(record(path)))
        elif getattr(mod, "output_quant", None) is not None and not shared:
            handles.append(mod.register_forward_hook(record(None)))
        if shared:
            handles.append(mod.register_forward_pre_hook(
                lambda m, a: feeds.append([t.grad_fn for t in _tensors(a) if t.grad_fn is not None])))
    try:
        with torch.enable_grad():
            prepared_model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    groups = []
    for nodes in feeds:
        members = set()
        for node in nodes:
            members |= _producers(node, stops, set())
        if len(members) > 1:
            groups.append(sorted(members))
    return groups
