"""Replaying the solved blocks of a model from their recorded outputs, so that a layer-by-layer
PTQ pass over block ``b`` does not run blocks ``0 .. b-2`` again.

A model whose blocks sit in an ``nn.ModuleList`` and run as a chain (block ``i + 1``'s first
argument is block ``i``'s output, or its first element: a transformer's decoder layers) can
have blocks ``0 .. c`` stood in for by ``Replay`` modules while a pass runs: each returns, for
the current calibration batch, the output block ``c`` gave on it when it last ran (recorded by
``record_outputs``); only the last one advances to the next batch. The forward of the rest of the
model is unchanged, so the pass computes exactly what a full forward would, provided the batches
come in the same order in every pass (the caller materialises them). Cost in memory: block
``c``'s outputs for every calibration batch (tokens x hidden values).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..calibration.batches import iter_inputs
from ..nn.modes import eval_mode


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _detach(out):
    if torch.is_tensor(out):
        return out.detach()
    if isinstance(out, tuple):
        return tuple(_detach(o) for o in out)
    return out


class Replay(nn.Module):
    """Stands in for a block: returns ``outputs[cursor[0]]`` (advancing the cursor when
    ``advance``); attributes it lacks are read from the block it replaces."""

    def __init__(self, block: nn.Module, outputs: list, cursor: list, advance: bool):
        super().__init__()
        self.__dict__["_block"] = block  # not a submodule: the replaced block's parameters stay out
        self.outputs, self.cursor, self.advance = outputs, cursor, advance

    def forward(self, *args, **kwargs):
        i = self.cursor[0]
        if i >= len(self.outputs):
            raise RuntimeError(f"dal.ptq replay: batch {i} was not recorded ({len(self.outputs)} were): the "
                               "calibration data gave a different number of batches in two passes")
        if self.advance:
            self.cursor[0] += 1
        return self.outputs[i]

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_block"], name)


@contextlib.contextmanager
def replayed(blocks: nn.ModuleList, upto: int, outputs: list):
    """``blocks[0 .. upto]`` replaced by ``Replay`` modules for the ``with`` block, all returning
    the recorded outputs of ``blocks[upto]``; the blocks are put back after (also on error)."""
    saved = [blocks[i] for i in range(upto + 1)]
    cursor = [0]
    for i in range(upto + 1):
        blocks[i] = Replay(saved[i], outputs, cursor, advance=i == upto)
    try:
        yield
    finally:
        for i, m in enumerate(saved):
            blocks[i] = m


def record_outputs(block: nn.Module, store: list):
    """A forward hook appending ``block``'s (detached) output of every call to ``store``; returns its handle."""
    def hook(_m, _args, out):
        store.append(_detach(out))
    return block.register_forward_hook(hook)


def chains(model: nn.Module, blocks: nn.ModuleList, data: Iterable, input_fn: Optional[Callable] = None) -> bool:
    """Whether the entries of ``blocks`` run once each, in order, each on the previous one's
    output (its first element for a tuple), on the first batch of ``data``."""
    calls: list = []

    def make(i):
        def hook(_m, args, kwargs, out):
            first = args[0] if args else next(iter(kwargs.values()), None)
            calls.append((i, first, _first(out)))
        return hook

    handles = [b.register_forward_hook(make(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad(), eval_mode(model):
            for args, kwargs in iter_inputs(data, 1, input_fn=input_fn, desc="dal.ptq"):
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if [i for i, _, _ in calls] != list(range(len(blocks))):
        return False
    return all(calls[i + 1][1] is calls[i][2] for i in range(len(calls) - 1))
