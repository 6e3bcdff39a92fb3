"""Carry out a checked plan: fuse Conv+BN(+ReLU) and quantize functional ops in the captured
graphs, swap leaf modules for their QAT classes, then the plan's model-wide actions (output
quantizers, sparsity, shared scales, power-of-two scales, freezing, the detector guard:
``actions.carry_out``). Nothing here decides: the plan did. What apply returns is the prepared
model; prepare installs nothing after it."""
from __future__ import annotations

import torch
from torch import nn

from ..nn import QConvBn2d, QConvBnReLU2d
from ..nn.conv_frozen_bn import QConvFrozenBn2d, QConvFrozenBnReLU2d
from ..nn.norm import fp16_norms
from ..nn.norm_act import ActAfterFold, NormActAffine, bare_batchnorm, is_norm_act
from ..nn.registry import QAT_MODULES, registry_type
from ..nn.fast_path import stay_on_module_path
from ..nn.gather import gather_call_args
from ..nn.grid_sample import grid_sample_args
from ..nn.scatter_add import scatter_call
from ..nn.tree import has_instance_attribute, instance_attributes, replace_everywhere, set_submodule, slots_of
from ..ops import by_module
from ..ops import get as get_op
from ..replace.rmsnorm import Fp16RMSNorm
from .actions import ModelActions, carry_out
from .call_sites import install
from .fp16_island import Fp16Function, island_module
from .functional_ops import call_form, cat_dim, rebuild
from .plan import Capture, Step

def _norm_class(action: str, float_type: type):
    """The normalisation module the plan chose for a ``float_type`` module and ``action``, or
    None: the QAT module of the float normalisation op matching the type exactly (dal.ops:
    QBatchNorm2d, Fp16GroupNorm, Fp16InstanceNorm2d), for ``fp16`` when it is an FP16 norm
    (dal.nn.norm.fp16_norms), else for ``quantize``."""
    op = by_module(float_type)
    if op is None or op.handling != "float" or op.qat_module is None:
        return None
    cls = op.resolve("qat_module")
    return cls if action == ("fp16" if cls in fp16_norms().values() else "quantize") else None


def apply_plan(model: nn.Module, plan: list[Step], cap: Capture, actions: ModelActions = None) -> nn.Module:
    """Rewrite ``model`` per ``plan`` and carry out ``actions``; returns the root (a GraphModule
    when the root's own forward was rewritten). Owners are rewritten deepest first, so a parent's
    rebuild sees its children's final modules; leaves are swapped afterwards, by path; the
    model-wide actions run last, on the final modules."""
    by_owner: dict[str, list[Step]] = {}
    leaf_steps = [s for s in plan if s.action in ("quantize", "fp16") and s.site is None and not s.node]
    # The float leaves, found before the owners' rewrites: a GraphModule keeps only the names its
    # graph calls, so a module shared under two names (timm CoaT's cpe1 = serial_blocks1.0.cpe)
    # may have lost the name the plan knows it by; it is swapped in every slot it holds.
    leaves = {s.path: _find(model, s.path) for s in leaf_steps}
    for step in plan:
        if step.site is not None:
            if step.action in ("functional", "fp16"):  # fp16: a softmax island (call_sites.routes_island)
                install(model, step.site, _site_module(step))
        elif step.action in ("fuse", "functional") or (step.action == "fp16" and step.node):
            by_owner.setdefault(step.owner, []).append(step)
    for owner in sorted(by_owner, key=lambda p: -(p.count(".") + bool(p))):
        mod = model.get_submodule(owner) if owner else model
        new = _rewrite(mod, cap.graphs[owner], by_owner[owner], owner)
        if owner:  # every name it has: a parent rewritten before may call it by another
            replace_everywhere(slots_of(model), mod, new)
        else:
            model = new
    slots = slots_of(model)
    for step in leaf_steps:
        mod = leaves[step.path]
        if mod is None or id(mod) not in slots:  # not a module of the model before the rewrites
            mod = model.get_submodule(step.path)
        replace_everywhere(slots, mod, _leaf_module(mod, step))
    stay_on_module_path(model)  # no fused TransformerEncoderLayer path past the quantizers (dal.nn.fast_path)
    if actions is not None:
        carry_out(model, actions)
    return model


def _find(model: nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _leaf_module(mod: nn.Module, step: Step) -> nn.Module:
    """The module a leaf step puts in ``mod``'s place."""
    if step.action == "quantize" and is_norm_act(mod):  # no conv to fold into (plan.py)
        return NormActAffine.from_norm_act(mod, step.spec, step.path)
    cls = _norm_class(step.action, type(mod))
    if step.action == "fp16" and step.built == "Fp16RMSNorm":  # an RMSNorm on an fp16 engine (check.py)
        return Fp16RMSNorm.from_module(mod, step.path)
    if cls is None and step.action == "fp16":  # a float op on an fp16 engine (check.py)
        return island_module(mod, step.path, step.op_class)
    cls = cls or QAT_MODULES[registry_type(type(mod))]
    return cls.from_float(mod, step.spec, step.path)


def _site_module(step: Step) -> nn.Module:
    if step.action == "fp16":  # the site's Fp16Function calls the Tensor method of its name
        return Fp16Function(step.site.op.function, step.path, step.op_class)
    cls, form = _qat_class(step), call_form(step.type_name)
    if form in ("index", "sampling"):  # params: (kind, dim) of a scatter-add / gather; grid_sample's attributes
        return cls(step.spec, step.path, *step.site.params)
    if form == "sequence":
        return cls(step.spec, step.path, arity=step.site.arity, dim=step.site.dim)
    return cls(step.spec, step.path)


def _qat_class(step: Step) -> type:
    """The QAT module of the functional op a step names (``dal.ops``: its ``qat_module``)."""
    return get_op(step.type_name).resolve("qat_module")


def _rewrite(mod: nn.Module, graph, steps: list[Step], owner: str) -> nn.Module:
    prefix = f"{owner}." if owner else ""
    nodes = {n.name: n for n in graph.nodes}
    for step in steps:
        if step.action == "fuse":
            _fuse(mod, graph, nodes, step)
        elif step.action == "fp16":
            _island_node(mod, graph, nodes[step.node], step, prefix)
        else:
            _functional(mod, graph, nodes[step.node], step, prefix)
    return keep_attributes(rebuild(mod, graph), mod)


def keep_attributes(gm: nn.Module, mod: nn.Module) -> nn.Module:
    """``gm`` (the GraphModule that replaces ``mod``) with ``mod``'s own plain attributes, the
    values a parent may read (torchvision RAFT reads ``self.update_block.hidden_state_size``):
    every entry of ``mod.__dict__`` that is not nn.Module's state, not dal's own (``dal_*`` /
    ``_dal_*``: a sparsity controller is bound to one root and moves itself, ``find_controller``)
    and that ``gm`` does not define. Methods of ``mod``'s class are not carried."""
    internal = instance_attributes(nn.Module()).keys() | {"training"}
    for key, value in instance_attributes(mod).items():
        if key.startswith(("dal_", "_dal_")):
            continue
        if key not in internal and not has_instance_attribute(gm, key) and not hasattr(type(gm), key):
            object.__setattr__(gm, key, value)  # not a class attribute of gm's: lands in its __dict__
    return gm


def _fuse(mod: nn.Module, graph, nodes: dict, step: Step) -> None:
    conv, bn = mod.get_submodule(step.node), mod.get_submodule(step.bn)
    cls = QConvBnReLU2d if step.relu else QConvBn2d
    if step.built.startswith("QConvFrozenBn"):  # a frozen BatchNorm (plan.py, dal.nn.frozen_bn)
        cls = QConvFrozenBnReLU2d if step.relu else QConvFrozenBn2d
    if is_norm_act(bn):  # timm's BatchNormAct2d: the BN folds, drop + act stay at their paths
        set_submodule(mod, step.node, cls.from_float(conv, bare_batchnorm(bn), step.spec, step.path))
        set_submodule(mod, step.bn, ActAfterFold(bn))
        return
    set_submodule(mod, step.node, cls.from_float(conv, bn, step.spec, step.path))
    conv_node = next(n for n in graph.nodes if n.op == "call_module" and n.target == step.node)
    bn_node = next(iter(conv_node.users))
    relu_node = next(iter(bn_node.users)) if step.relu else None
    bn_node.replace_all_uses_with(conv_node)
    graph.erase_node(bn_node)
    if relu_node is not None:
        relu_node.replace_all_uses_with(conv_node)
        graph.erase_node(relu_node)
    parent_path, _, leaf = step.bn.rpartition(".")
    delattr(mod.get_submodule(parent_path) if parent_path else mod, leaf)


def _island_node(mod: nn.Module, graph, node, step: Step, prefix: str) -> None:
    """A float function of a traced forward on an fp16 engine: an Fp16Function module in its place."""
    attr = step.path[len(prefix):]
    attr = attr if not hasattr(mod, attr) else f"{attr}_fp16"
    fn = node.target
    args, kwargs = node.args, dict(node.kwargs)
    if not args:  # torch.sigmoid(input=x): Fp16Function takes the tensor first, positionally
        key = next((k for k in ("input", "self") if k in kwargs), None)
        if key is None:
            raise ValueError(f"{step.path}: cannot find the tensor argument of {getattr(fn, '__name__', fn)} "
                             f"(keywords {sorted(kwargs)}); pass it positionally")
        args = (kwargs.pop(key),)
    mod.add_module(attr, Fp16Function(fn, prefix + attr, step.op_class))
    with graph.inserting_after(node):
        new = graph.call_module(attr, args, kwargs)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _functional(mod: nn.Module, graph, node, step: Step, prefix: str) -> None:
    attr = step.path[len(prefix):]
    cls, form, in_place = _qat_class(step), call_form(step.type_name), False
    if form == "sequence":  # torch.cat(tensors, dim)
        tensors = node.args[0] if node.args else node.kwargs["tensors"]
        qmod = cls(step.spec, step.path, arity=len(tensors), dim=cat_dim(node))
        args = tuple(tensors)
    elif form == "sampling":  # F.grid_sample / torch.grid_sampler: attributes from the call
        mode, padding, align = grid_sample_args(node.args, dict(node.kwargs), node.target is torch.grid_sampler)
        qmod = cls(step.spec, step.path, mode, padding, align)
        args = (node.args[0] if node.args else node.kwargs["input"],
                node.args[1] if len(node.args) > 1 else node.kwargs["grid"])
    elif step.type_name == "scatter_add":  # index_put_(accumulate) / scatter_add / index_add: dal.nn.scatter_add
        kind, dim, x, index, src, in_place = scatter_call(node.target, node.args, dict(node.kwargs),
                                                          node.op == "call_method")
        qmod, args = cls(step.spec, step.path, kind, dim), (x, index, src)
    elif step.type_name == "gather":  # gather / index_select / take_along_dim: dal.nn.gather
        kind, dim, x, index = gather_call_args(node.target, node.args, dict(node.kwargs), node.op == "call_method")
        qmod, args = cls(step.spec, step.path, kind, dim), (x, index)
    else:  # two tensor operands
        qmod = cls(step.spec, step.path)
        args = (node.args[0], node.args[1])
    mod.add_module(attr, qmod)
    with graph.inserting_after(node):
        new = graph.call_module(attr, args)
    node.replace_all_uses_with(new)
    if in_place:
        _after_in_place(graph, node, args[0], new)
    graph.erase_node(node)


def _after_in_place(graph, node, dest, new) -> None:
    """``dest.index_put_(...)`` wrote into ``dest``: its later readers read ``new`` (the module's
    out-of-place result) instead."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for user in list(dest.users):
        if user is not new and order[user] > order[node]:
            user.replace_input_with(dest, new)
