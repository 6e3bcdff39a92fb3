"""The source line of each node of a module's own forward, for the prepare report.

prepare's capture (``dal.nn.own_forward``) does not record stack traces (they cost time on every
node of every module). Where the report needs a line -- an op the hardware cannot run -- the
module's forward is traced once more with a tracer that records them, every submodule a leaf as
in the capture, so the node names match.

    node_lines(mod) -> {node name: "file.py:123"}      ({} when the forward does not trace)
"""
from __future__ import annotations

import os
import re

import torch.fx as fx
from torch import nn

from ..nn.own_forward import attributes_kept

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


class _LineTracer(fx.Tracer):
    """Every submodule call a leaf; each node's ``stack_trace`` recorded."""

    def __init__(self):
        super().__init__()
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:  # noqa: D401
        return True


def node_lines(mod: nn.Module) -> dict[str, str]:
    """``{node name: "file:line"}`` of ``mod``'s own forward: the innermost frame of each node's
    stack trace that lies in the file defining the forward (else the innermost frame)."""
    try:
        with attributes_kept(mod):  # a forward that caches on itself keeps no Proxy
            graph = _LineTracer().trace(mod)
        home = os.path.abspath(type(mod).forward.__code__.co_filename)
    except Exception:  # noqa: BLE001 -- a forward fx cannot trace again: no lines, not an error
        return {}
    out = {}
    for node in graph.nodes:
        frames = _FRAME.findall(node.stack_trace or "")
        if not frames:
            continue
        mine = [f for f in frames if os.path.abspath(f[0]) == home]
        path, line = (mine or frames)[-1]
        out[node.name] = f"{os.path.basename(path)}:{line}"
    return out
