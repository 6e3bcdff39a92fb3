"""Reading a module's *own* forward with torch.fx, and the Conv2d -> BatchNorm2d (-> ReLU)
chains in it that fold into one QConvBn2d / QConvBnReLU2d.

Shared by ``dal.prepare`` (which fuses the chains) and ``dal.replace``'s report-only
``conv_bn_relu`` rule (which lists them before training), so both see the same chains.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch.fx as fx
from torch import nn

from ..ops import by_call
from .frozen_bn import is_frozen_batchnorm
from .norm_act import is_norm_act


class _OwnForwardTracer(fx.Tracer):
    """Every submodule call is a leaf: only the module's own forward is traced. The root's
    ``training`` flag reads as a Proxy of ``self.training`` (a ``get_attr`` node), not as the
    bool it holds while tracing (:func:`trace_own_forward`); torch traces a GraphModule's code
    again with this class when it loads one from a pickle, which then keeps the flag live too."""

    def trace(self, root, concrete_args=None):
        module = root if isinstance(root, nn.Module) else None
        self._flag_owner = module
        flag = module.__dict__.get("training", _UNSET) if module is not None else _UNSET
        try:
            return super().trace(root, concrete_args)
        finally:
            if module is not None:
                if flag is _UNSET:
                    module.__dict__.pop("training", None)
                else:
                    module.__dict__["training"] = flag

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:  # noqa: D401
        return True

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        # called by trace() once its graph exists, just before it runs the forward
        if getattr(self, "_flag_owner", None) is not None:
            self._flag_owner.__dict__["training"] = self.create_proxy("get_attr", "training", (), {})
        return super().create_args_for_root(root_fn, is_module, concrete_args)


def trace_own_forward(mod: nn.Module) -> fx.Graph:
    """The fx graph of ``mod.forward`` with submodule calls as ``call_module`` leaves, including
    a submodule's ``forward`` called directly (``down.forward(y)``, timm's HRNet head): fx only
    sees ``__call__``, so that forward's own calls (a Sequential's conv, bn, relu) would land in
    this graph as well as in the submodule's, and the Conv+BN fusion was then planned in both.

    Raises ValueError for a forward that tests an argument against None, or tests an argument's
    type: fx passes a Proxy, so the graph keeps one branch. timm's DLA block
    (``if shortcut is None: shortcut = x``) became ``out + None``; timm's SelecSLS block
    (``if not isinstance(x, list): x = [x]``) wrapped its list input in a list and fed the list
    to a conv. The caller leaves such a forward to the call-site capture, which runs it as written.

    ``self.training`` is read at run time, not frozen: fx would write the bool it held while
    tracing into the graph, so timm's GhostNet (``F.dropout(x, p, training=self.training)``),
    prepared in train mode, kept dropping out in eval and in its export. The flag is a Proxy while
    tracing: passed to a call, the graph reads ``self.training`` there; a branch on it
    (``if self.training:``) cannot trace and raises, and the forward goes to the call-site capture."""
    checked = _none_checked_arguments(type(mod).forward)
    if checked:
        raise ValueError(f"forward tests {', '.join(checked)} against None (torch.fx would keep one branch)")
    typed = _type_tested_arguments(type(mod).forward)
    if typed:
        raise ValueError(f"forward tests the type of {', '.join(typed)} (torch.fx passes a Proxy and would keep "
                         "one branch)")
    with attributes_kept(mod):
        return _trace_leaves(mod)


def _trace_leaves(mod: nn.Module) -> fx.Graph:
    tracer = _OwnForwardTracer()
    subs = [m for m in mod.modules() if m is not mod]
    saved = [(m, m.__dict__.get("forward", _UNSET)) for m in subs]
    for m in subs:
        # An instance attribute shadows the class's forward for ``m.forward(...)`` only; the
        # tracer's patched ``__call__`` does not read it (every submodule is a leaf).
        m.__dict__["forward"] = _leaf_call(tracer, m, m.forward)
    try:
        return tracer.trace(mod)
    finally:
        for m, prev in saved:
            if prev is _UNSET:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = prev


_UNSET = object()


@contextmanager
def attributes_kept(mod: nn.Module) -> Iterator[nn.Module]:
    """Trace ``mod`` inside this block: on exit its plain attributes are what they were before.

    A forward may cache on itself what it computes: torchvision's ``MultiScaleRoIAlign`` stores
    ``self.scales`` / ``self.map_levels`` on its first call. Under fx those are Proxies, which
    the real forward would then use ("Proxy object cannot be iterated" in Mask R-CNN's training
    step after a ``replace:`` rule traced it). Holds for every entry of ``mod.__dict__`` except
    its parameter, buffer and submodule tables and fx's own constants: a key added while tracing
    is removed, a changed or deleted one put back. fx stores a tensor the forward makes
    (``FrozenBatchNorm2d``'s ``eps`` arithmetic) on the root as ``_tensor_constant<i>`` /
    ``_param_constant<i>``, which the graph reads: those stay. Submodules are not covered (a
    leaf tracer never runs them)."""
    saved = {k: v for k, v in mod.__dict__.items() if k not in _TABLES}
    try:
        yield mod
    finally:
        for k in [k for k in mod.__dict__ if k not in saved and k not in _TABLES and not k.startswith(_FX_CONSTANTS)]:
            del mod.__dict__[k]
        mod.__dict__.update(saved)


_TABLES = ("_parameters", "_buffers", "_modules")
_FX_CONSTANTS = ("_tensor_constant", "_param_constant")


def _leaf_call(tracer: fx.Tracer, sub: nn.Module, forward):
    def call(*args, **kwargs):
        return tracer.call_module(sub, forward, args, kwargs)
    return call


def _type_tested_arguments(forward) -> list[str]:
    """The arguments of ``forward`` whose type its source tests (``isinstance(x, ...)``,
    ``type(x)``, ``torch.is_tensor(x)``)."""
    import inspect
    import re

    try:
        names = [n for n in inspect.signature(forward).parameters if n != "self"]
        source = inspect.getsource(forward)
    except (TypeError, ValueError, OSError):
        return []
    return [n for n in names if re.search(rf"\b(isinstance|type|is_tensor)\(\s*{n}\b\s*[,)]", source)]


def _none_checked_arguments(forward) -> list[str]:
    """The arguments of ``forward`` with a default of None that its source compares with None."""
    import inspect
    import re

    try:
        params = inspect.signature(forward).parameters.values()
        source = inspect.getsource(forward)
    except (TypeError, ValueError, OSError):
        return []
    return [p.name for p in params if p.default is None and re.search(rf"\b{p.name}\s+is\s+(not\s+)?None\b", source)]


def needs_tracing(mod: nn.Module) -> bool:
    """Containers and user modules have forwards worth reading; torch.nn leaves and plain
    ModuleList / ModuleDict (no forward of their own) do not."""
    from .base import QATModule
    from .registry import QAT_MODULES, registry_type

    if isinstance(mod, (QATModule, fx.GraphModule)):
        return False
    if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and type(mod).forward is nn.Module.forward:
        return False  # a plain container has no forward; a subclass with one (torchvision's
        # IntermediateLayerGetter, a ModuleDict: conv1 -> bn1 -> relu of every detector's
        # backbone) is read like any module, so its Conv + BN fold
    if registry_type(type(mod)) in QAT_MODULES:
        return False  # a registered type is swapped whole by its QAT class
    if isinstance(mod, nn.Sequential):
        return True
    module = type(mod).__module__
    return not module.startswith(("torch.nn.modules", "dal.nn", "dal.quantizer", "dal.observers"))


def folds_as_batchnorm(m) -> bool:
    """A BatchNorm2d whose forward is torch's: a subclass with a forward of its own would lose
    that part if folded into a conv, so it is planned as the module it is (listed, with the
    hardware's verdict), never folded; timm's BatchNormAct2d folds its BN only (norm_act.py)."""
    return isinstance(m, nn.BatchNorm2d) and type(m).forward is nn.BatchNorm2d.forward


@dataclass
class ConvBnPattern:
    conv: str          # attribute path of the conv inside the traced module
    bn: str
    relu_node: Optional[fx.Node]
    nodes: tuple = field(default=())
    frozen: bool = False  # the BN is a frozen BatchNorm (frozen_bn.py), recognised by what it computes


def _is_relu(node: fx.Node, modules: dict) -> bool:
    """The node computes the op named ``relu`` of :mod:`dal.ops` (its module type, functions or
    Tensor methods: ``nn.ReLU``, ``F.relu``, ``torch.relu``, ``x.relu_()``): the ReLU a
    conv-BN chain fuses."""
    op = by_call(node.op, type(modules.get(node.target)) if node.op == "call_module" else node.target)
    return op is not None and op.name == "relu"


def find_conv_bn(graph: fx.Graph, mod: nn.Module) -> list[ConvBnPattern]:
    """Conv2d -> BatchNorm2d (-> ReLU) chains where each link has a single user and each
    module is called exactly once in this forward; a frozen BatchNorm (``frozen_bn.py``: found by
    what it computes, e.g. torchvision's FrozenBatchNorm2d) in the BN's place is one too."""
    modules = dict(mod.named_modules())
    calls: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    found = []
    for n in graph.nodes:
        if n.op != "call_module" or type(modules.get(n.target)) is not nn.Conv2d or len(n.users) != 1:
            continue
        user = next(iter(n.users))
        bn = modules.get(user.target) if user.op == "call_module" else None
        act_inside = is_norm_act(bn)
        if bn is None or not user.args or user.args[0] is not n or calls[n.target] != 1 or calls[user.target] != 1:
            continue  # (checked first: recognising a frozen BN runs its forward once on a probe)
        frozen = not (folds_as_batchnorm(bn) or act_inside) and is_frozen_batchnorm(bn)
        if not (folds_as_batchnorm(bn) or act_inside or frozen):
            continue
        relu = None
        if len(user.users) == 1 and not act_inside:
            nxt = next(iter(user.users))
            if _is_relu(nxt, modules) and nxt.args[0] is user:
                relu = nxt
        found.append(ConvBnPattern(n.target, user.target, relu, (n, user), frozen))
    return found
