"""The functional ops prepare quantizes in a traced forward (``+``, ``*``, ``@``, ``cat``), and
rebuilding a module from its rewritten graph.

Tracing module by module (``dal.nn.own_forward``: submodule calls are leaves), instead of the
whole model at once, is what lets prepare_qat work on models that do not trace as a whole
(torchvision's detection heads with data-dependent post-processing).
"""
from __future__ import annotations

import copy
import functools
import operator
from typing import Optional

import torch.fx as fx
from torch import nn

from ..nn.tree import has_instance_attribute
from ..ops import Op, all_ops, by_function, by_method, select, version

# ---- functional ops: the registry's ops of handling "functional" (dal.ops) ----------------------
def call_form(kind: str) -> str:
    """How prepare reads a call of the functional op named ``kind``: that op's ``call_form``
    (dal.ops: ``"operands"``, two tensor operands, ``"sequence"``, ``"sampling"`` or ``"index"``);
    ``"operands"`` for a name no op has."""
    return _call_forms(version()).get(kind, "operands")


@functools.cache
def _call_forms(_version: int) -> dict[str, str]:
    return {op.name: op.call_form for op in all_ops()}


def functional_ops() -> tuple[Op, ...]:
    """The ops prepare replaces by a quantized functional module (``handling == "functional"``),
    a user's registered ones included."""
    return _functional_ops(version())


@functools.cache
def _functional_ops(_version: int) -> tuple[Op, ...]:
    return select(handling="functional")


def functional_op_of(node: fx.Node) -> Optional[Op]:
    """The functional op an fx ``call_function`` / ``call_method`` node calls, by its target, or
    None. fx writes Python operators as ``operator.*`` functions, so a dunder method name
    (``x.__add__(y)`` written out) is no functional call here."""
    if node.op == "call_function":
        op = by_function(node.target)
    elif node.op == "call_method" and not (node.target.startswith("__") and node.target.endswith("__")):
        op = by_method(node.target)
    else:
        return None
    return op if op is not None and op.handling == "functional" else None


_NON_TENSOR_METHODS = {"size", "dim", "numel", "__len__", "item", "tolist", "stride"}
_NON_TENSOR_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda"}


def is_tensor_node(node) -> bool:
    """Best effort: does this fx value hold a tensor (not a shape, int or dtype)?"""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "placeholder" and _annotated_non_tensor(node.type):  # size: Tuple[int, int] (timm CoaT)
        return False
    if node.op == "call_method" and node.target in _NON_TENSOR_METHODS:
        return False
    if node.op == "call_function":
        if node.target is getattr and len(node.args) > 1 and node.args[1] in _NON_TENSOR_ATTRS:
            return False
        if node.target in (len, int, float):
            return False
        if node.target is operator.getitem:
            return is_tensor_node(node.args[0]) and not _is_shape_like(node.args[0])
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
        if tensor_args and not any(is_tensor_node(a) for a in tensor_args):
            return False
    return True


def _annotated_non_tensor(annotation) -> bool:
    """An argument annotated as an int, a float, a bool, or a tuple / list of them."""
    if annotation in (int, float, bool):
        return True
    args = getattr(annotation, "__args__", None)
    origin = getattr(annotation, "__origin__", None)
    return origin in (tuple, list) and bool(args) and all(a in (int, float, bool, Ellipsis) for a in args)


def _is_shape_like(node) -> bool:
    return (node.op == "call_method" and node.target in _NON_TENSOR_METHODS) or (
        node.op == "call_function" and node.target is getattr and len(node.args) > 1
        and node.args[1] in _NON_TENSOR_ATTRS)


def functional_kind(node: fx.Node) -> Optional[str]:
    """The name of the functional op (``dal.ops``, handling ``functional``: "add", "mul",
    "matmul", "cat", "grid_sample", "scatter_add", "gather", a user's) when the node is a
    quantizable call of it on tensors (:func:`call_form`: two tensor operands without ``alpha``
    or keywords other than ``out``; a sequence of two or more tensors; ``input`` and ``grid``
    tensors; a scatter-add / gather that ``dal.nn.scatter_add.scatter_call`` /
    ``dal.nn.gather.gather_call_args`` parse), else None."""
    if node.op in ("call_function", "call_method"):
        kind = index_kind(node)
        if kind is not None:
            return kind
    op = functional_op_of(node)
    if op is None:
        return None
    form = call_form(op.name)
    if form == "index":
        return None  # index_kind parsed it: not a call the module computes
    if form == "sampling":
        a = node.args[0] if node.args else node.kwargs.get("input")
        b = node.args[1] if len(node.args) > 1 else node.kwargs.get("grid")
        return op.name if is_tensor_node(a) and is_tensor_node(b) else None
    if form == "sequence":
        seq = node.args[0] if node.args else node.kwargs.get("tensors")
        if isinstance(seq, (list, tuple)) and len(seq) >= 2 and all(is_tensor_node(t) for t in seq):
            return op.name
        return None
    if len(node.args) < 2 or set(node.kwargs) - {"out"}:
        return None
    if node.kwargs.get("alpha") is not None:
        return None
    a, b = node.args[0], node.args[1]
    return op.name if is_tensor_node(a) and is_tensor_node(b) else None


def index_kind(node: fx.Node) -> Optional[str]:
    """"scatter_add" / "gather" for a scatter-add or gather call on tensors (the module doc's
    other kinds: None)."""
    from ..nn.gather import gather_call_args
    from ..nn.scatter_add import scatter_call

    method = node.op == "call_method"
    sc = scatter_call(node.target, node.args, dict(node.kwargs), method)
    if sc is not None:
        return "scatter_add" if all(is_tensor_node(t) for t in sc[2:5]) else None
    gc = gather_call_args(node.target, node.args, dict(node.kwargs), method)
    if gc is not None:
        return "gather" if is_tensor_node(gc[2]) and is_tensor_node(gc[3]) else None
    return None


def cat_dim(node: fx.Node) -> int:
    """The dimension of a ``torch.cat`` node: its second argument, or the keyword ``dim`` or
    ``axis`` (torch.cat / concat / concatenate take either), else 0."""
    if len(node.args) > 1:
        return int(node.args[1])
    return int(node.kwargs.get("dim", node.kwargs.get("axis", 0)))


class RewrittenModule(fx.GraphModule):
    """The GraphModule prepare puts in place of a module whose forward it rewrote. Unlike
    fx.GraphModule, ``copy.deepcopy`` keeps every entry of its ``__dict__`` (deep-copied), so the
    plain attributes a parent reads (``prepare.apply.keep_attributes``: RAFT's
    ``update_block.hidden_state_size``) survive the copies dal.convert and users make."""

    def __deepcopy__(self, memo):
        res = super().__deepcopy__(memo)
        for key, value in self.__dict__.items():
            if not has_instance_attribute(res, key):
                object.__setattr__(res, key, copy.deepcopy(value, memo))
        return res


def rebuild(mod: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule (:class:`RewrittenModule`) running ``graph`` over ``mod``'s submodules (same
    objects, same names)."""
    graph.lint()
    gm = RewrittenModule(mod, graph, class_name=type(mod).__name__)
    # The root's own flag only: gm.train() would also reset every child, undoing a user's
    # frozen BN or dropout inside a training model.
    gm.training = mod.training
    return gm

