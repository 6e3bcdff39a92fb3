"""prepare's plan: one pass over the model decides, for every module and every functional op it
sees, what prepare will do and why; the hardware check and the report read the plan.

Capture traces each module's *own* forward once (``dal.nn.own_forward``: submodule calls are
leaves), so a module whose forward torch.fx cannot trace keeps it, everything below it is still
planned, and the failure is a note. The graphs are kept for ``apply``, which rewrites them.

A :class:`Step` has an ``action``:

* ``quantize`` — swap for the registered QAT module; ``fuse`` — Conv2d + BatchNorm2d (+ ReLU)
  into one QConvBn2d (a frozen BatchNorm, ``dal.nn.frozen_bn``: QConvFrozenBn2d); ``functional``
  — ``+``, ``*``, ``@``, ``cat`` in a traced forward get a QAdd / QMul / QMatMul / QCat;
* ``ready-made`` — already a QAT module (operator replacement, or the user's);
* ``passthrough`` — exact on integer codes (ReLU, max pool, reshape, ...);
* ``fp16`` — a normalisation (GroupNorm, InstanceNorm2d) run in FP16 on hardware with an FP16
  vector engine (``dal.nn.norm``), or a float op on an engine with ``compute: fp16`` (an FP16
  island, ``fp16_island.py``), decided by the hardware check;
* ``float`` — left in float, with the reason (no rule quantizes it, no QAT module, a float op
  such as SiLU or an unfolded BatchNorm; ``hardware_verdict`` says whether the chip runs it);
* ``host`` — an op of a class the hardware model does not list (``HOST_OP_CLASSES``: nonzero,
  integer compares, gathers by index, cumsum, top-k, 3-D conv), decided by the hardware check, with
  its source line; ``strict=True`` refuses it.

After the check, a float forward on the example inputs (``example_run``) turns the steps whose
float module never runs into ``float`` steps, and the model-wide actions (output quantizers,
sparsity, shared scales, power-of-two scales, scales-only freezing, the detector guard) are
decided as ``actions.ModelActions``: apply carries out both, and the report renders both.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx
from torch import nn

from ..hardware.op_classes import HOST_OP_CLASSES
from ..nn.base import QATModule
from ..nn.norm_act import is_norm_act
from ..nn.own_forward import find_conv_bn, needs_tracing, trace_own_forward
from ..nn.registry import OP_CLASSES, QAT_MODULES, op_class_of, registry_type
from ..ops import get as get_op
from ..quantizer import FakeQuantizer
from .float_ops import FloatOp, classify_module, classify_node
from .functional_ops import call_form, functional_kind, is_tensor_node
from .position_ops import position_arithmetic
from .whole_modules import planned_whole
from .source_lines import node_lines


def functional_class(kind: str) -> str:
    """The class name of the QAT module built for the functional op named ``kind`` (its
    ``dal.ops`` entry's ``qat_module``: ``"QAdd"`` for ``"add"``)."""
    return get_op(kind).resolve("qat_module").__name__


ACTIONS = ("quantize", "fuse", "functional", "ready-made", "passthrough", "fp16", "float", "host")


@dataclass(frozen=True)
class Step:
    """One decision: ``path`` (module path, or ``<owner>.<node>`` for a functional op), the
    float ``type_name``, the hardware ``op_class``, the ``action``, the recipe ``spec`` (a
    ``LayerSpec`` or None) and the ``reason``. ``owner`` / ``node`` locate functional ops and
    fused chains in their owner's graph; ``float_op`` says how a float step computes."""

    path: str
    type_name: str
    op_class: str
    action: str
    spec: object = None
    reason: str = ""
    owner: str = ""
    node: str = ""
    bn: str = ""
    relu: bool = False
    float_op: Optional[FloatOp] = None
    built: str = ""
    after: str = ""  # a functional op: the module called just before it in its owner's forward
    site: object = None  # a call site in a forward fx cannot trace (``call_sites.Site``)

    @property
    def shown_type(self) -> str:
        """The class the step builds (``QConv2d``), else the float type."""
        return self.built or self.type_name

    @property
    def fp16(self) -> bool:
        return bool(getattr(self.spec, "fallback_fp16", False))


@dataclass
class Capture:
    """Each traced module's graph by path, and why the others did not trace."""

    graphs: dict = field(default_factory=dict)
    untraced: dict = field(default_factory=dict)


def capture(model: nn.Module) -> Capture:
    """Trace the own forward of every module that has one worth reading, once each."""
    cap = Capture()
    for path, mod in model.named_modules():
        if not needs_tracing(mod) or planned_whole(mod) is not None:  # an RMSNorm, a formula activation
            continue
        try:  # the module's plain attributes stay as they were (own_forward.attributes_kept)
            cap.graphs[path] = trace_own_forward(mod)
        except Exception as err:  # noqa: BLE001 - any tracing failure means "leave this forward as is"
            msg = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
            cap.untraced[path] = (type(mod).__name__, msg)
    return cap


def build_plan(model: nn.Module, cap: Capture, resolve, extra: tuple = ()) -> list[Step]:
    """Every module and functional op of ``model``, in module order, with its decision.

    ``resolve(path, type_name, op_class) -> LayerSpec | None`` is the recipe's first-match
    lookup (None: no rule, or a ``skip`` rule). ``extra``: steps found elsewhere (the call sites
    of forwards fx cannot trace, :func:`site_steps`), ordered after their owner."""
    steps: list[Step] = list(extra)
    fused: set[str] = set()  # BN paths folded into a conv, and convs that fuse
    calls = _calls_across_graphs(model, cap)
    for owner, graph in cap.graphs.items():
        if owner in fused:
            continue  # a BatchNormAct2d folded by its parent: its own forward is replaced (norm_act.py)
        mod = model.get_submodule(owner) if owner else model
        if owner and _affine_norm_act(owner, mod, resolve):
            continue  # quantized whole by its module step (its batch_norm call is the QBatchNorm2d)
        prefix = f"{owner}." if owner else ""
        for pat in find_conv_bn(graph, mod):
            conv = prefix + pat.conv
            spec = resolve(conv, "Conv2d", "conv")
            if spec is None or max(calls[id(mod.get_submodule(p))] for p in (pat.conv, pat.bn)) > 1:
                continue  # a conv or BN another forward also calls: folding here would change that call
            fused |= {conv, prefix + pat.bn}
            if pat.relu_node is not None and pat.relu_node.op == "call_module":
                fused.add(prefix + pat.relu_node.target)  # erased from the graph with the fusion
            relu = pat.relu_node is not None
            # the report names every module a fused chain absorbs (a ReLU module by its path)
            act = f" ({prefix + pat.relu_node.target})" if relu and pat.relu_node.op == "call_module" else ""
            kind = "FrozenBn" if pat.frozen else "Bn"  # a frozen BN: found by what it computes (nn/frozen_bn.py)
            steps.append(Step(conv, "Conv2d", "conv", "fuse", spec, f"fused with {prefix + pat.bn}"
                              + (" (a frozen BatchNorm)" if pat.frozen else "") + (f" + relu{act}" if relu else ""),
                              owner, pat.conv, pat.bn, relu, built=f"QConv{kind}ReLU2d" if relu else f"QConv{kind}2d"))
        steps += _functional_steps(graph, mod, prefix, owner, resolve)
    steps = [s for s in steps if not _replaced_forward(s, fused, model, resolve)]
    for path, mod in model.named_modules():
        if path and path not in fused and not _inside_quantized(path, model):
            step = _module_step(path, mod, resolve)
            if step is not None:
                steps.append(step)
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    # Modules in module order; a functional op right after the module its forward called before it.
    return sorted(steps, key=lambda s: (order[s.path], 0) if s.path in order else (order.get(s.after, -1), 1))


def _replaced_forward(step: Step, fused: set, model: nn.Module, resolve) -> bool:
    """A call site inside a timm BatchNormAct2d whose forward prepare replaces: folded into its
    conv (``fused``: ActAfterFold runs drop + act only) or quantized whole (NormActAffine). Its
    ``F.batch_norm`` never runs in the prepared model, so it is no float op to report or check."""
    if step.site is None or not step.owner:
        return False
    mod = model.get_submodule(step.owner)
    return is_norm_act(mod) and (step.owner in fused or _affine_norm_act(step.owner, mod, resolve))


def _calls_across_graphs(model: nn.Module, cap: Capture) -> dict[int, int]:
    """How many ``call_module`` nodes of all captured graphs call each module (by identity): a
    module some parent's forward reaches into (``self.block.conv(x)``) is called from two graphs."""
    calls: dict[int, int] = {}
    for owner, graph in cap.graphs.items():
        mod = model.get_submodule(owner) if owner else model
        for n in graph.nodes:
            if n.op == "call_module":
                key = id(mod.get_submodule(n.target))
                calls[key] = calls.get(key, 0) + 1
    return calls


def site_steps(sites, resolve) -> list[Step]:
    """Steps for the call sites ``call_sites.discover`` found in forwards fx cannot trace: a
    tensor-tensor ``+ * @ cat`` is quantized per the recipe (or left float, with why), any other
    op is listed as passthrough or float with its FloatOp, for the hardware check."""
    steps = []
    for site in sites:
        where = f"called at {site.line}"
        if site.kind is not None:
            spec = resolve(site.path, site.kind, site.kind)
            if spec is None:
                steps.append(Step(site.path, site.kind, site.kind, "float", None,
                                  f"no recipe rule quantizes it; {where}", site.owner, site=site, after=site.owner))
            else:
                steps.append(Step(site.path, site.kind, site.kind, "functional", spec, where, site.owner, site=site,
                                  built=functional_class(site.kind), after=site.owner))
            continue
        op = site.op
        reason = f"exact on integer codes; {where}" if op.kind == "passthrough" else where
        steps.append(Step(site.path, op.function, op.op_class, op.kind, None, reason, site.owner, float_op=op,
                          site=site, after=site.owner))
    return steps


def _inside_quantized(path: str, model: nn.Module) -> bool:
    """Inside a QAT module (its own float children, e.g. a replaced block's internals), or inside
    a module of a registered type, which its QAT class swaps whole (peft's LoRA Linear)."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        parent = model.get_submodule(".".join(parts[:i]))
        if isinstance(parent, (QATModule, FakeQuantizer)) or registry_type(type(parent)) in QAT_MODULES:
            return True
    return False


def _functional_steps(graph: fx.Graph, mod: nn.Module, prefix: str, owner: str, resolve) -> list[Step]:
    steps = []
    after, lines = owner, None
    for node in graph.nodes:
        if node.op == "call_module":
            after = prefix + str(node.target)
        name = prefix + node.name
        kind = functional_kind(node)
        if kind is not None and call_form(kind) == "index" and resolve(name, kind, kind) is None:
            kind = None  # not quantized: listed as the float op it is (a host op where the NPU lacks it)
        if kind is not None and position_arithmetic(node):
            steps.append(Step(name, kind, kind, "float", None, "position arithmetic (from integer positions, e.g. "
                              "rotary cos/sin tables): no quantizer", owner, node.name, after=after))
            continue
        if kind is not None:
            spec = resolve(name, kind, kind)
            if spec is None:
                steps.append(Step(name, kind, kind, "float", None, "no recipe rule quantizes it", owner, node.name,
                                  after=after))
            else:
                # The QAT module becomes an attribute of the owner named after the node.
                attr = node.name if not hasattr(mod, node.name) else f"{node.name}_q"
                steps.append(Step(prefix + attr, kind, kind, "functional", spec, "", owner, node.name,
                                  built=functional_class(kind), after=after))
            continue
        op = classify_node(node)
        if op is None and _leaf_function(node):
            fn = node.target
            steps.append(Step(name, fn.__name__, "custom", "float", None, f"calls {fn.__module__}.{fn.__name__}, a "
                              "function torch.fx keeps whole (torch.fx.wrap): the ops inside run in float, none is "
                              "quantized", owner, node.name, after=after))
            continue
        # not x.shape[0] and the like; a host op's operands were checked by classify_node
        # (an arange of a size is a tensor there, not for is_tensor_node)
        if op is not None and (is_tensor_node(node) or op.op_class in HOST_OP_CLASSES):
            reason = "exact on integer codes" if op.kind == "passthrough" else ""
            if op.op_class in HOST_OP_CLASSES:  # the report names where (source_lines.py)
                lines = lines if lines is not None else node_lines(mod)
                reason = f"called at {lines[node.name]}" if node.name in lines else ""
            steps.append(Step(name, op.function, op.op_class, op.kind, None, reason, owner, node.name,
                              float_op=op, after=after))
    return steps


def _leaf_function(node: fx.Node) -> bool:
    """A call of a Python function that fx did not trace into (``torch.fx.wrap``: torchvision's
    ``shifted_window_attention``, ``_patch_merging_pad``), with a tensor argument: its ``+ * @ cat``
    are invisible to prepare, so the call is one float row. torch's, Python's and dal's own
    functions (known to their modules) are not."""
    fn = node.target
    module = getattr(fn, "__module__", None) or ""
    return (node.op == "call_function" and isinstance(fn, types.FunctionType)
            and module.split(".")[0] not in ("torch", "dal", "_operator", "operator", "builtins", "math")
            and any(is_tensor_node(a) for a in (*node.args, *node.kwargs.values())))


def _affine_norm_act(path: str, mod: nn.Module, resolve) -> bool:
    """timm's BatchNormAct2d left unfolded that a recipe rule quantizes (as a conv, like a plain
    unfolded BatchNorm2d): it becomes dal.nn.norm_act.NormActAffine."""
    return is_norm_act(mod) and resolve(path, type(mod).__name__, "conv") is not None


def _module_step(path: str, mod: nn.Module, resolve) -> Optional[Step]:
    type_name = type(mod).__name__
    if isinstance(mod, QATModule):
        quantizers = mod.quantizers()
        if not quantizers:
            return None
        formats = {role: q.fmt.name for role, q in quantizers.items()}
        return Step(path, type_name, op_class_of(mod), "ready-made", None,
                    "ready-made: " + " ".join(f"{role}={fmt}" for role, fmt in formats.items()))
    if isinstance(mod, FakeQuantizer) or isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
        return None
    if _affine_norm_act(path, mod, resolve):
        return Step(path, type_name, "conv", "quantize", resolve(path, type_name, "conv"),
                    "not folded (no Conv2d before it in a forward torch.fx traces): its BN a quantized "
                    f"per-channel affine (depthwise 1x1 conv) at {path}.bn, drop and act kept at their paths",
                    built="QBatchNorm2d")
    whole = planned_whole(mod)
    if whole is not None:  # found by what it computes (whole_modules.py); check.py decides
        what = "an RMSNorm" if whole.function == "rmsnorm" else f"a {whole.function} written as a formula"
        return Step(path, type_name, whole.op_class, "float", None, f"{what} (found by what it computes)",
                    float_op=whole)
    if needs_tracing(mod):
        # A container's forward is captured; a user module that also owns parameters uses them
        # in that forward itself, which no QAT class quantizes.
        if registry_type(type(mod)) in QAT_MODULES or next(mod.parameters(recurse=False), None) is None:
            return None
    cls = QAT_MODULES.get(registry_type(type(mod)))
    if cls is not None:
        op_class = OP_CLASSES[registry_type(type(mod))]
        spec = resolve(path, type_name, op_class)
        if spec is None:
            return Step(path, type_name, op_class, "float", None, "no recipe rule quantizes it")
        return Step(path, type_name, op_class, "quantize", spec, built=cls.__name__)
    op = classify_module(mod)
    if op is None:
        return None
    if needs_tracing(mod):
        op = FloatOp("float", "custom", type_name)
    if op.kind == "passthrough":
        return Step(path, type_name, op.op_class, "passthrough", None, "exact on integer codes", float_op=op)
    if type(mod) is nn.BatchNorm2d and (spec := resolve(path, type_name, "conv")) is not None:
        # Not folded, but still a per-channel affine: a depthwise 1x1 conv on the matrix engine.
        return Step(path, type_name, "conv", "quantize", spec, "not folded (it does not directly follow a Conv2d "
                    "called once in a forward torch.fx traces): a quantized per-channel affine (depthwise 1x1 conv)",
                    built="QBatchNorm2d")
    reason = ""
    if op.op_class == "custom":
        reason = f"no QAT module registered for {type_name}: register one with @dal.register_qat_module({type_name})"
    elif op.function == "batchnorm":
        reason = "not folded: it does not directly follow a Conv2d called once in a forward torch.fx traces"
    return Step(path, type_name, op.op_class, "float", None, reason, float_op=op)
