"""Sequential loops that let the next layer's input quantizer write in place (``install``).

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

Everything else runs torch's loop unchanged: eval, no grad, tracing and compiling, the first
child (its input comes from the caller, who may read it again). A pickled model loads with
torch's loop (the instance ``forward`` is not restored); a deep copy keeps it.
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

#: autograd nodes that keep their inputs for the backward, never their output
_KEEPS_NO_OUTPUT = frozenset({
    "NativeBatchNormBackward0", "ConvolutionBackward0", "AddBackward0", "MulBackward0", "CatBackward0",
    "_IslandFunctionBackward", "ReluMaskFunctionBackward"})

#: QAT forwards that start with ``x = self.input_quant(x)`` and read ``x`` only through it
_QUANT_FIRST_FORWARDS = (QWeightedModule.forward, QConvBn2d.forward)

_SEQUENTIAL_FORWARD = nn.Sequential.forward


def install(model: nn.Module) -> int:
    """Give every Sequential in ``model`` that runs torch's loop the loop of the module doc;
    returns how many. Idempotent."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Sequential) and type(m).forward is _SEQUENTIAL_FORWARD and "forward" not in m.__dict__:
            m.forward = SoleInputLoop(m)
            n += 1
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
        if q is None or q._forward_pre_hooks or q._forward_hooks or _torch_module._global_forward_hooks:
            return None
        return q


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
