"""Sequential loops and graph edges that let the next layer's input quantizer write in place.

In a QAT training step every input quantizer writes its fake quantization into a new
full-size tensor, because its input may have other readers. That write is most of what the
activation quantizers cost: on SSDlite320 at batch 2, replacing each of them by ``x.clone()``
costs ~20 of their ~36 ms a step (bench/results/detection_speed.md, session 15). Where the
quantizer is provably its input's only reader it may write into the input instead: the same
values, the same gradient, one tensor fewer.

Where that is provable. torch's ``nn.Sequential.forward`` is ``for module in self: input =
module(input)``: child k's output is passed to child k + 1 and the loop variable is rebound,
so the loop itself reads it once. :func:`install` gives each Sequential that runs torch's loop
(its class does not override ``forward``; torchvision's ``Conv2dNormActivation`` is one) the
same loop as an instance ``forward``, which, between two children, checks the tensor child k
returned:

* the loop holds the only Python reference (``sys.getrefcount``): no module or hook kept it
  (a view made in Python holds its base too);
* nothing else shares its memory (``_base``, and the storage's use count: a ``detach()`` someone
  kept, a view made in C++, and the alias autograd keeps of an output it saved all count there);
* its autograd node is one known to keep its inputs only (BatchNorm, conv, add, mul, cat, an FP16
  island, dal's bit-mask ReLU). ``torch.relu_`` keeps its result, which is why ``QConvBn2d``
  trains with ``formats.relu_mask``;

and finds the quantizer that will read it first: child k + 1, or its first child through
nested Sequentials that run this loop, must be a QAT layer whose forward starts with
``x = self.input_quant(x)`` and reads ``x`` only through it (``QWeightedModule.forward``,
``QConvBn2d.forward``), with no forward pre-hook on the way (a pre-hook sees the input) and no
hook on the quantizer. It then *offers* the tensor to that quantizer for the call
(``dal.quantizer_sole_input``); the quantizer writes in place only on the bound C++ route of a
QAT step (``formats.track_call.TrackCall.in_place``) and otherwise computes as before. A node
that saved the tensor after all fails at the backward with autograd's "modified by an inplace
operation" (the write bumps its version): never silently.

The same inside a GraphModule (prepare traces most blocks into one; its generated forward calls
the layers itself): :func:`install` inserts an :func:`offer_output` node on each graph edge from
a call_module node to the only node that reads it, a call_module whose module reads that
argument through a quantizer (the QAT layers above; ``QAdd`` / ``QMul`` / ``QMatMul`` / ``QCat``
through ``input_quants[i]``). fx's graph proves the single use; at run time ``offer_output``
checks the tensor as the loop does (fx's code holds it in one local during the call). The node
is the identity, and transparent to tracing and export.

Everything else runs torch's loop unchanged: eval, no grad, tracing and compiling, the first
child (its input comes from the caller, who may read it again). Pickles and deep copies keep
the loops (each bound to its own Sequential) and the graph nodes.
tests/nn/test_sole_input.py compares training steps with and without the in-place writes, bit
for bit, and checks each refusal.
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch import fx, nn
from torch.nn.modules import module as _torch_module

from .. import quantizer_sole_input as sole_input
from .base import QWeightedModule
from .conv_bn import QConvBn2d
from .functional import QAdd, QCat, QMatMul, QMul
from .weight_bound import watched

#: autograd nodes that keep their inputs for the backward, never their output
_KEEPS_NO_OUTPUT = frozenset({
    "NativeBatchNormBackward0", "ConvolutionBackward0", "AddBackward0", "MulBackward0", "CatBackward0",
    "_IslandFunctionBackward", "ReluMaskFunctionBackward"})

#: QAT forwards that start with ``x = self.input_quant(x)`` and read ``x`` only through it
_QUANT_FIRST_FORWARDS = (QWeightedModule.forward, QConvBn2d.forward)

#: the functional modules that read argument i only through ``input_quants[i]``
_FUNCTIONAL_FORWARDS = (QAdd.forward, QMul.forward, QMatMul.forward, QCat.forward)

_SEQUENTIAL_FORWARD = nn.Sequential.forward


def install(model: nn.Module) -> int:
    """Give every Sequential in ``model`` that runs torch's loop the loop of the module doc, and
    every GraphModule its :func:`offer_output` nodes; returns how many loops and nodes. Idempotent."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Sequential) and type(m).forward is _SEQUENTIAL_FORWARD and "forward" not in m.__dict__:
            m.forward = SoleInputLoop(m)
            n += 1
        elif isinstance(m, fx.GraphModule) and not any(
                node.op == "call_function" and node.target is offer_output for node in m.graph.nodes):
            n += _install_graph(m)
    return n


class SoleInputLoop:
    """A Sequential's instance ``forward``: ``nn.Sequential.forward``, offering each child's
    output to the next child's input quantizer where that quantizer is its only reader (module
    doc). An object rather than a bound method so that the model pickles and loads with it, and a
    deep copy gets one for its own Sequential."""

    __slots__ = ("seq",)

    def __init__(self, seq: nn.Sequential):
        self.seq = seq

    def __reduce__(self):
        return SoleInputLoop, (self.seq,)

    def __call__(self, input):
        seq = self.seq
        if not (seq.training and torch.is_grad_enabled()) or torch.jit.is_tracing() \
                or torch.compiler.is_compiling() or _torch_module._global_forward_pre_hooks:
            return _SEQUENTIAL_FORWARD(seq, input)
        return _loop(seq._modules, input)


def _loop(modules: dict, input):
    first = True
    for module in modules.values():
        # 2: the loop's variable and getrefcount's argument, nothing else holds the tensor
        if not first and type(input) is torch.Tensor and sys.getrefcount(input) == 2 and _unshared(input):
            q = _first_input_quant(module)
            if q is not None:
                sole_input.offer(q, input)
                try:
                    input = module(input)
                finally:
                    sole_input.withdraw()
                continue
        first = False
        input = module(input)
    return input


def _unshared(t: torch.Tensor) -> bool:
    """No view, no base, and an autograd node that does not keep ``t`` (module doc)."""
    node = t.grad_fn
    # 2: the tensor and the temporary storage object of this call
    return (node is not None and type(node).__name__ in _KEEPS_NO_OUTPUT and t._base is None
            and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2)


def _first_input_quant(module: nn.Module):
    """The quantizer that reads ``module``'s input first and only, or None (module doc)."""
    while True:
        if module._forward_pre_hooks:
            return None
        if isinstance(module, fx.GraphModule):
            module = _graph_sole_callee(module)
            if module is None:
                return None
            continue
        if isinstance(module, nn.Sequential):
            own = module.__dict__.get("forward")
            if type(module).forward is not _SEQUENTIAL_FORWARD or not module._modules or not (
                    own is None or (type(own) is SoleInputLoop and own.seq is module)):
                return None
            module = next(iter(module._modules.values()))
            continue
        if type(module).forward not in _QUANT_FIRST_FORWARDS:
            return None
        q = module._modules.get("input_quant")
        return None if q is None or watched(q) else q


#: per GraphModule: (its compiled forward, the submodule its input goes to alone, or None)
_CALLEES: "weakref.WeakKeyDictionary[fx.GraphModule, tuple]" = weakref.WeakKeyDictionary()


def _graph_sole_callee(gm: fx.GraphModule):
    """The submodule a GraphModule passes its one input to, where that call is the input's only
    use in the graph; else None. Read from the graph once per compiled ``forward`` (fx
    recompiles, with a new ``forward``, after a graph edit)."""
    forward = type(gm).forward
    hit = _CALLEES.get(gm)
    if hit is None or hit[0] is not forward:
        hit = _CALLEES[gm] = (forward, _sole_callee_target(gm.graph))
    return None if hit[1] is None else gm.get_submodule(hit[1])


def _sole_callee_target(graph: fx.Graph):
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1 or len(inputs[0].users) != 1:
        return None
    user = next(iter(inputs[0].users))
    return user.target if user.op == "call_module" and user.args == (inputs[0],) and not user.kwargs else None


def offer_output(t, reader: nn.Module, position: int):
    """Identity, inserted by :func:`install` into a GraphModule's graph between a call_module
    node and the one call_module node that reads its output (at argument ``position``): offers
    ``t`` to the quantizer that reads it there, when nothing else holds it (module doc)."""
    # 3: the GraphModule's local (fx frees it after this call), this parameter, getrefcount's argument
    if type(t) is torch.Tensor and sys.getrefcount(t) == 3 and reader.training and torch.is_grad_enabled() \
            and not (torch.jit.is_tracing() or torch.compiler.is_compiling()) and _unshared(t):
        q = _input_quant_at(reader, position)
        if q is not None:
            sole_input.offer(q, t)
    return t


def _install_graph(gm: fx.GraphModule) -> int:
    """Insert :func:`offer_output` on every edge of ``gm``'s graph from a call_module node to the
    one call_module node that reads it, where that reader reads it through a quantizer."""
    graph, n = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        for i, arg in enumerate(node.args):
            if not (isinstance(arg, fx.Node) and arg.op == "call_module" and len(arg.users) == 1
                    and node.args.count(arg) == 1 and _input_quant_at(gm.get_submodule(node.target), i) is not None):
                continue
            with graph.inserting_after(arg):
                reader = graph.get_attr(node.target)
            with graph.inserting_after(reader):
                offered = graph.call_function(offer_output, (arg, reader, i))
            node.replace_input_with(arg, offered)
            n += 1
    if n:
        graph.lint()
        gm.recompile()
    return n


def _input_quant_at(reader: nn.Module, position: int):
    """The quantizer through which ``reader`` reads its argument ``position`` first and only, or None."""
    if isinstance(reader, (QAdd, QMul, QMatMul, QCat)):
        if type(reader).forward not in _FUNCTIONAL_FORWARDS or reader._forward_pre_hooks \
                or position >= len(reader.input_quants):
            return None
        q = reader.input_quants[position]
        return None if watched(q) else q
    return _first_input_quant(reader) if position == 0 else None
