"""One operator dal knows, declared once: what it matches in a float model and what each stage
(prepare, export, convert, cost) does with it.

An :class:`Op` is data. The stages above this layer read it through :mod:`dal.ops.registry`;
references to their implementations (a QAT module in ``dal.nn``, an integer form in
``dal.convert``) are ``"module:attribute"`` names, resolved when a stage asks for them
(:meth:`Op.resolve`), so that this layer imports nothing above it. A user's op
(``@dal.ops.register``) may give the objects themselves.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

#: how prepare treats a matched call or module:
#: ``quantize`` (a QAT module replaces the module), ``functional`` (a quantized functional op
#: replaces the call: ``+``, ``@``, ``cat``), ``passthrough`` (exact on codes: the value keeps its
#: quantization), ``float`` (a float op of the hardware's vector engine: an FP16 island or a
#: lookup table where the hardware model allows it), ``host`` (an op class no NPU engine runs).
HANDLINGS = ("quantize", "functional", "passthrough", "float", "host")

#: an op's parts in an FP16 / BF16 region of the export (export/SPEC.md §6): ``compute`` (its
#: ``onnx`` nodes compute in the region's format when their float inputs are in it), ``tail`` (a
#: region extends through its nodes when their other inputs are constants: a fused activation)
FP16_ROLES = ("compute", "tail")

#: the engine the cost model charges: ``matrix`` (MACs), ``vector`` (element-wise passes),
#: ``free`` (folded away or exact on codes: no cycles of its own).
COST_CLASSES = ("matrix", "vector", "free")

#: how prepare reads the call of a ``functional`` op (its fx node and its call-site capture):
#: ``operands`` (two tensor operands: ``a + b``, ``a @ b``, ``torch.mul(a, b)``, no ``alpha``),
#: ``sequence`` (``torch.cat(tensors, dim)``: two or more tensors), ``sampling``
#: (``F.grid_sample(input, grid, ...)`` / ``torch.grid_sampler``: dal.nn.grid_sample), ``index``
#: (a scatter-add / gather: ``dal.nn.scatter_add.scatter_call`` / ``dal.nn.gather.gather_call_args``
#: parse it, and a site no recipe rule quantizes stays the host op it is)
CALL_FORMS = ("operands", "sequence", "sampling", "index")

Ref = Union[str, Callable, type, None]


@dataclass(frozen=True)
class Op:
    """An operator: the float patterns it matches and, for each stage, what that stage uses.

    - ``name``: the registry key (unique), e.g. ``"add"``, ``"sigmoid"``, ``"conv"``;
    - ``op_class``: the hardware op class recipes and hardware models name
      (:mod:`dal.hardware.op_classes`);
    - ``handling``: one of :data:`HANDLINGS`;
    - ``functions``: torch callables a model calls (fx ``call_function`` targets and the functions
      a call-site capture sees: ``torch.add``, ``operator.add``, ``F.relu``);
    - ``methods``: ``torch.Tensor`` method names, in-place and operator (dunder) forms included;
    - ``modules``: float ``nn.Module`` types;
    - ``qat_module``: the QAT module prepare builds (``"dal.nn.functional:QAdd"``), or None;
    - ``onnx``: the ONNX node types of its export pattern, besides Q / DQ (``("Add",)``);
    - ``spec``: the export/SPEC.md section that states the pattern's semantics (``"§3"``);
    - ``integer_form``: dal.convert's form of it (``"dal.convert.float_ops:sigmoid_f64"``), or None
      when the integer model runs the op unchanged (exact on codes, or the ONNX op's own
      float semantics equal torch's); a form that depends on the call or on the export's opset is
      a factory ``(func, opset) -> form`` (dal/convert/op_forms.py ``form_factory``);
    - ``cost``: one of :data:`COST_CLASSES`, or None when the cost model does not charge it;
    - ``function``: the function name hardware models use in ``fp16_ops`` / ``lut_ops``
      (``"silu"``), when it differs from ``name`` or matters;
    - ``fp16_region``: its parts in an FP16 / BF16 region of the export, members of
      :data:`FP16_ROLES` (``("compute", "tail")`` for ``add``), read by dal/export/casts.py;
    - ``neutral``: ``(n, both_sides)`` for arithmetic with a neutral Python int: ``x op n == x``,
      and ``n op x == x`` too when ``both_sides`` (add ``(0, True)``, sub ``(0, False)``, mul
      ``(1, True)``). An out-of-place call with it (alpha 1) leaves no node in the export
      (export/SPEC.md §5a), so prepare lists no op there and dal.convert computes none.
    - ``call_form``: how prepare reads a call of a ``functional`` op, one of :data:`CALL_FORMS`
      (``"operands"``, the default: two tensor operands; ``"sequence"`` for ``cat``).
    """

    name: str
    op_class: str
    handling: str
    functions: tuple = ()
    methods: tuple = ()
    modules: tuple = ()
    qat_module: Ref = None
    onnx: tuple = ()
    spec: str = ""
    integer_form: Ref = None
    cost: Optional[str] = None
    function: str = ""
    fp16_region: tuple = ()
    neutral: Optional[tuple] = None
    call_form: str = "operands"

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"an Op needs a name (a non-empty str), got {self.name!r}")
        if self.handling not in HANDLINGS:
            raise ValueError(f"Op {self.name!r}: handling={self.handling!r} is not one of {', '.join(HANDLINGS)}")
        if self.cost is not None and self.cost not in COST_CLASSES:
            raise ValueError(f"Op {self.name!r}: cost={self.cost!r} is not one of {', '.join(COST_CLASSES)}")
        for field in ("functions", "methods", "modules", "onnx", "fp16_region"):
            value = getattr(self, field)
            if not isinstance(value, tuple):
                raise TypeError(f"Op {self.name!r}: {field} must be a tuple, got {type(value).__name__}")
        if self.call_form not in CALL_FORMS:
            raise ValueError(f"Op {self.name!r}: call_form={self.call_form!r} is not one of {', '.join(CALL_FORMS)}")
        if any(r not in FP16_ROLES for r in self.fp16_region):
            raise ValueError(f"Op {self.name!r}: fp16_region={self.fp16_region!r}: members are {', '.join(FP16_ROLES)}")
        if self.neutral is not None and not (isinstance(self.neutral, tuple) and len(self.neutral) == 2
                                             and type(self.neutral[0]) is int and isinstance(self.neutral[1], bool)):
            raise TypeError(f"Op {self.name!r}: neutral is (int, bool), got {self.neutral!r}")
        if any(not isinstance(m, str) for m in self.methods):
            raise TypeError(f"Op {self.name!r}: methods are Tensor method names (str), got {self.methods!r}")
        if any(not isinstance(m, type) for m in self.modules):
            raise TypeError(f"Op {self.name!r}: modules are nn.Module types, got {self.modules!r}")

    def resolve(self, field: str) -> Any:
        """The object ``field`` refers to: a ``"package.module:attribute"`` name is imported and
        looked up; any other value is returned as it is."""
        return resolve_ref(getattr(self, field), f"Op {self.name!r}: {field}")


def resolve_ref(ref: Ref, what: str = "reference") -> Any:
    """Import ``"package.module:attribute"`` and return the attribute; other values unchanged."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} = {ref!r}: a reference is 'package.module:attribute'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} = {ref!r}: {module} has no attribute {attr!r}") from None
    return obj
