"""dal.convert(qat_model): the deployed integer model in torch, bit-exact with the NPU.

    int_model = dal.convert(model)            # a calibrated / trained QAT model
    y = int_model(x)                          # what the chip computes (no autograd)
    y, codes = int_model.run_with_codes(x)    # also {quantizer path: [integer codes per call]}
    print(int_model.summary())                # which layers run as integer groups, which in float
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from ..formats import quantize
from ..nest import tensors
from ..nn.base import QATModule, QWeightedModule
from ..nn.conv_bn import QConvBn2d
from ..nn.norm import QBatchNorm2d
from ..quantizer import FakeQuantizer
from .accumulate import OVERFLOWS
from .blocked_linear import BLOCKED_FLOAT
from .compiled import capture_blocks
from .codes_boundary import integer_boundary
from .errors import ConvertError
from .float_ops import NPUFloatOps
from .forms import swap_forms
from .layers import IntegerLayer, fan_value
from .nan_screen import holds_nan
from .opset import called_functions, export_opset
from .probe import plan_groups, record
from .quant_calls import use_integer_quantizers


class Requantizer:
    """The hardware model's requantizer: kind "float", "fixed_point" (bits, rounding) or
    "power_of_two" (a shift, rounding), and its accumulator (``accumulator_bits`` B with
    ``accumulator_overflow`` "saturate" or "wrap"; None: exact)."""

    KINDS = ("float", "fixed_point", "power_of_two")

    def __init__(self, kind: str = "float", multiplier_bits: int = 31, rounding: str = "half_up",
                 accumulator_bits: Optional[int] = None, accumulator_overflow: str = "saturate"):
        if kind not in self.KINDS:
            raise ConvertError(f"the hardware's requantizer kind {kind!r} has no integer model here "
                               f"(one of {', '.join(self.KINDS)})")
        if accumulator_overflow not in OVERFLOWS:
            raise ConvertError(f"the hardware's accumulator_overflow {accumulator_overflow!r} is not one of "
                               f"{', '.join(OVERFLOWS)}")
        self.kind, self.multiplier_bits, self.rounding = kind, int(multiplier_bits), rounding
        self.accumulator_bits = None if accumulator_bits is None else int(accumulator_bits)
        self.accumulator_overflow = accumulator_overflow

    def __repr__(self):
        acc = ("" if self.accumulator_bits is None
               else f", {self.accumulator_bits}-bit accumulator ({self.accumulator_overflow})")
        if self.kind == "float":
            return f"float requantizer (ONNX QuantizeLinear){acc}"
        if self.kind == "power_of_two":
            return f"power-of-two requantizer (shift, {self.rounding}){acc}"
        return f"fixed-point requantizer ({self.multiplier_bits}-bit multiplier, {self.rounding}){acc}"


def requantizer_of(model: nn.Module) -> Requantizer:
    """The requantizer and accumulator of the hardware ``model`` was prepared for (float and
    exact when none)."""
    from ..prepare.handle import find_prepared
    handle = find_prepared(model)
    hw = getattr(handle, "hardware", None)
    rq = getattr(hw, "requantizer", None)
    acc = dict(accumulator_bits=getattr(hw, "accumulator_bits", None),
               accumulator_overflow=getattr(hw, "accumulator_overflow", None) or "saturate")
    if rq is None:
        return Requantizer(**acc)
    kind = getattr(rq, "kind", rq if isinstance(rq, str) else "float")
    return Requantizer(kind, getattr(rq, "multiplier_bits", None) or 31,
                       getattr(rq, "rounding", None) or "half_up", **acc)


def _check_calibrated(model: nn.Module, opset: Optional[int]) -> int:
    """The export opset of ``model`` (``opset`` checked, or the exporter's default); ConvertError
    naming every quantizer never calibrated or still observing."""
    from ..export.errors import ExportError
    from ..export.plan import make_plan
    try:
        return make_plan(model).resolve_opset(opset)
    except ExportError as e:
        raise ConvertError(f"dal.convert: {e}".replace("before dal.export_onnx", "before dal.convert")) from None


def _weighted(m: nn.Module) -> bool:
    """A layer with an integer group: Conv / Linear, Conv+BN, and a BatchNorm no conv absorbs
    (QBatchNorm2d: a depthwise 1x1 conv, with running statistics)."""
    return isinstance(m, (QWeightedModule, QConvBn2d)) or (isinstance(m, QBatchNorm2d) and m.running_mean is not None)


def _refuse_nan(args: tuple, kwargs: dict) -> None:
    """ConvertError naming the first float input that holds NaN: QuantizeLinear leaves the code
    of NaN undefined, and mapping it to a zero point would be a silently wrong result."""
    named = [(f"input {i}", a) for i, a in enumerate(args)] + [(f"input {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        for j, t in enumerate(tensors(value)):  # any nest (dal.nest), dataclasses too
            if t.is_floating_point() and holds_nan(t):
                where = "" if j == 0 and isinstance(value, torch.Tensor) else f" (tensor {j} in it)"
                n = int(torch.isnan(t).sum())
                raise ConvertError(f"integer model: {name}{where} holds {n} NaN of {t.numel()} elements; "
                                   "the NPU's QuantizeLinear has no code for NaN: clean the input first")


def _slice_batch(args: tuple) -> tuple:
    """The first sample of every batched tensor argument, when they all share dim 0 (probe)."""
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    if ts and all(t.ndim > 0 and t.shape[0] == ts[0].shape[0] for t in ts) and ts[0].shape[0] > 1:
        return tuple(a[:1] if isinstance(a, torch.Tensor) else a for a in args)
    return args


class IntegerModel(nn.Module):
    """The converted model; ``forward`` takes and returns what the QAT model's does: the same
    nest (dict, dataclass, ``ModelOutput``, lists, non-tensor leaves), tensor leaves in the
    order of the exported file's outputs (dal.nest)."""

    def __init__(self, net: nn.Module, layers: dict, requantizer: Requantizer, forms: Optional[dict] = None,
                 opset: Optional[int] = None, explicit_opset: bool = False):
        super().__init__()
        self.net = net
        # the export's: functional GELU / LayerNorm / SDPA are spelled by it (float_ops.py); the
        # formats' default until the probe forward sees the functions that raise it (opset.py)
        self.opset = opset
        self._explicit_opset = explicit_opset
        self.requantizer = requantizer
        self._layers = layers  # path -> IntegerLayer (also inside net)
        self.forms = dict(forms or {})  # path of a replaced operator -> its form (forms.py)
        self._planned = False
        # a fixed-point fan-out group's per-reader values, for the duration of one forward
        self._fan: dict = {}
        self._fan_hooked: set = set()
        for lay in layers.values():
            lay.fan_values = self._fan
        use_integer_quantizers(net)  # the same values, less per-call overhead (quant_calls.py)

    def _plan(self, args, kwargs) -> None:
        layers = list(self._layers.values())
        for lay in layers:
            lay.probing = True
        try:
            events, outputs = record(self.net, _slice_batch(args), kwargs, layers)
        finally:
            for lay in layers:
                lay.probing = False
        if self.opset is not None:
            self.opset = export_opset(self.opset, self._explicit_opset, called_functions(events))
        plans = plan_groups(events, outputs)
        for lay in layers:
            lay.plans = plans.get(id(lay), [])
            for p in lay.plans:
                for q in p.consumers:  # a fan-out reader that is a quantizer call of its own
                    if id(q) not in self._fan_hooked:
                        self._fan_hooked.add(id(q))
                        q.register_forward_pre_hook(self._fan_reader)
        self._planned = True

    def _fan_reader(self, q, args):
        """Forward pre-hook of a fan-out reader quantizer: it quantizes its own value (layers.py)."""
        if args:
            y = fan_value(self._fan, args[0], q)
            if y is not args[0]:
                return (y,) + tuple(args[1:])
        return None

    #: the NPUFloatOps of the forward in progress (None outside one), and whether captured blocks
    #: (compiled.py) run eagerly in it: plain attributes, read by compile_blocks' blocks
    _mode = None
    _eager = False

    def forward(self, *args, **kwargs):
        _refuse_nan(args, kwargs)
        with torch.no_grad():
            if not self._planned:
                self._plan(args, kwargs)
            for lay in self._layers.values():
                lay.calls = 0
            try:
                with NPUFloatOps(self._fan, self.opset) as mode:
                    self._mode = mode
                    return self.net(*args, **kwargs)
            finally:
                self._mode = None
                self._fan.clear()

    def run_with_codes(self, *args, fp8_bits: bool = False, **kwargs) -> tuple[Any, dict]:
        """(output, {quantizer path: [codes of each call]}): every integer tensor of the run, the
        values the NPU's QuantizeLinear outputs hold (storage dtype of the format). With
        ``fp8_bits`` also every FP8 tensor, as its bit patterns (uint8: compare them bit for bit)."""
        if not self._planned:
            with torch.no_grad():
                self._plan(args, kwargs)  # before the taps: the probe forward is not this run
        taps: dict = {}
        hooks = []

        def hook(q, inputs, output):
            if q.state not in ("quantize", "frozen") or not (q.fmt.is_integer or (fp8_bits and q.fmt.is_float8)):
                return
            s, zp = q.effective_qparams()
            c = quantize(inputs[0], q.fmt, s, zp, q.granularity)
            taps.setdefault(q.name, []).append(c.view(torch.uint8) if q.fmt.is_float8 else c)
        for m in self.net.modules():
            if isinstance(m, FakeQuantizer):
                hooks.append(m.register_forward_hook(hook))
        for lay in self._layers.values():
            lay.taps = taps
        self._eager = True  # captured blocks (compiled.py) would run no taps
        try:
            out = self(*args, **kwargs)
        finally:
            self._eager = False
            for h in hooks:
                h.remove()
            for lay in self._layers.values():
                lay.taps = None
        return out, taps

    def compile_blocks(self, blocks) -> int:
        """Run each of ``blocks`` (a submodule path of ``self.net`` naming a module or a ModuleList, or an
        iterable of its submodules: a decoder's layers) as one graph captured by ``torch.compile`` with an
        eager backend (no inductor) from the next forward on: the same outputs bit for bit, for a model
        not changed afterwards (dal/convert/compiled.py states the contract). Returns how many
        blocks. ConvertError before the first forward (it plans the groups), for a model with
        fixed-point fan-out groups and for a block outside ``self.net``."""
        if not self._planned:
            raise ConvertError("compile_blocks: run the integer model once first (its first forward plans the groups)")
        if self._fan_hooked:
            raise ConvertError("compile_blocks: the model has fixed-point fan-out groups, whose per-reader values "
                               "are Python state of a forward: not captured")
        return capture_blocks(self.net, blocks, lambda: NPUFloatOps(self._fan, self.opset), self._forward_mode)

    def _forward_mode(self):
        """The NPUFloatOps of the forward in progress, or None: outside a forward, and in run_with_codes
        (its taps are Python hooks: captured blocks run eagerly there)."""
        return None if self._eager else self._mode

    def layer_forms(self) -> dict[str, str]:
        """{layer path: "integer" | "float: <why>"} (after the first forward)."""
        forms = {}
        for path, lay in self._layers.items():
            if BLOCKED_FLOAT in lay.ran and "integer" not in lay.ran:  # export/SPEC.md §5a, layers.py
                forms[path] = BLOCKED_FLOAT
            elif lay.why_not:
                forms[path] = f"float: {lay.why_not}"
            elif not lay.plans or not all(p.fused for p in lay.plans):
                why = next((p.why for p in lay.plans if not p.fused), "never called")
                forms[path] = f"float: output {why} (the NPU runs it in float too)"
            elif any(r.startswith("float: ") for r in lay.ran):
                forms[path] = next(r for r in lay.ran if r.startswith("float: "))
            else:
                forms[path] = "integer"
        return forms

    def group_calls(self) -> dict[str, tuple[int, int]]:
        """{weight quantizer name: (calls run as one integer group, calls)} after the first forward.
        The exporter names each weight's codes ``<name>.codes``; dal.verify compares these counts
        with the NPU reference's fused groups, layer for layer (a layer fused on one side only
        computes with two roundings on the other: a code apart at near-ties)."""
        out = {}
        for lay in self._layers.values():
            q = getattr(lay.qat, "weight_quant", None)
            if q is None or not lay.plans:
                continue
            floated = lay.why_not or any(r.startswith("float: ") for r in lay.ran)
            out[q.name] = (0 if floated else sum(p.fused for p in lay.plans), len(lay.plans))
        return out

    def summary(self) -> str:
        forms = self.layer_forms()
        n_int = sum(v == "integer" for v in forms.values())
        lines = [f"integer model: {n_int} of {len(forms)} weighted layers as integer groups, {self.requantizer}"]
        lines += [f"  {p}: {f}" for p, f in forms.items() if f != "integer"]
        if self.forms:
            n_form = sum(not f.startswith("QAT module") for f in self.forms.values())
            lines.append(f"  {n_form} of {len(self.forms)} replaced operators (attention, softmax, "
                         "layer norm, LUT) in their exported form")
            lines += [f"  {p}: {f}" for p, f in self.forms.items() if f.startswith("QAT module")]
        return "\n".join(lines)


def _swap(parent: nn.Module, name: str, new: nn.Module) -> None:
    if isinstance(parent, (nn.Sequential, nn.ModuleList)) and name.isdigit():
        parent[int(name)] = new
    else:
        setattr(parent, name, new)


def convert(model: nn.Module, example_inputs: Optional[tuple] = None, opset: Optional[int] = None) -> IntegerModel:
    """The integer model of a calibrated QAT ``model``: what the NPU computes, in torch.

    Every weighted layer (Conv2d, Linear, Conv+BN) whose output the NPU requantizes becomes an
    integer group: exact integer accumulation (float32 over channel chunks that keep every
    partial sum below 2^24 on the CPU, float64 on CUDA; see dal/convert/accumulate.py), the
    hardware's accumulator width (saturate or wrap, accumulate.py) and its requantizer (float
    scale, fixed-point multiplier and shift, or a power-of-two shift, with its rounding;
    requant.py). The replaced operators of dal.replace (``QMatMul``, ``NpuSoftmax``,
    ``Fp16LayerNorm``, ``QLutActivation``) compute what their exported nodes compute (forms.py).
    Every other tensor follows ONNX Q/DQ semantics (the QAT model's frozen quantizers) and
    export/SPEC.md's float-island rules (float_ops.py). The numbers come from the torch model
    (scales, zero points, folded and masked weights, int32 bias codes), not from an ONNX file.
    ``model`` is not changed. Structure (which layers are integer groups) is read by one probe
    forward (probe.py) on the first call, or here on ``example_inputs``. ``opset``: the one the
    file is exported at, when not the exporter's default (LayerNorm and GELU are spelled
    differently from opset 17 and 20 on); left None, it is that default as the exporter reaches
    it, the formats' lowest raised by the probe forward to 14 when the model calls
    ``F.scaled_dot_product_attention`` (opset.py); an explicit one below that is refused.

    A Linear on rank > 2 inputs with an int32 bias (MatMul + Add in the file) is an integer
    group like a Gemm. Not covered yet (see export/SPEC.md §5a; ``summary()`` lists what runs as
    its QAT module): an FP16 QMatMul with no output quantizer, and ops an FP16 region pulls in
    after a layer's own Relu / Clip. A layer without an integer form (per-group weights,
    Conv1d, ...) runs in float, as on the NPU, and ``summary()`` lists it with the reason.

    Raises ConvertError naming the quantizers of a model never calibrated or still observing;
    the integer model raises it on an input holding NaN (ONNX leaves its code undefined).

    >>> int_model = dal.convert(qat_model)          # doctest: +SKIP
    >>> int_model(x).equal(torch.from_numpy(dal.npu.run(path, {"input": x.numpy()})[0]))  # doctest: +SKIP
    True
    """
    explicit = opset is not None
    opset = _check_calibrated(model, opset)
    rq = requantizer_of(model)
    net = copy.deepcopy(model).eval()
    net.requires_grad_(False)
    layers = {}
    for path, mod in list(net.named_modules()):
        if not (_weighted(mod) and isinstance(mod, QATModule)) or not path:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        layers[path] = IntegerLayer(mod, path, rq)
        _swap(parent, name, layers[path])
    integer_boundary(net)  # a decoder file's codes boundary outside the dispatch (codes_boundary.py)
    im = IntegerModel(net, layers, rq, swap_forms(net, opset, _swap), opset, explicit)
    if example_inputs is not None:
        args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        with torch.no_grad():
            im._plan(args, {})
    return im
