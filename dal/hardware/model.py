"""What an NPU can do, as frozen dataclasses validated on construction.

A ``HardwareModel`` lists its engines, and for each op class the engine that runs it and the
formats allowed for its weights, inputs and outputs; rules for weight and activation
quantization; the requantizer; and sparsity, fp16, lookup-table and resize capabilities.
See ``hardware_models/README.md`` for the YAML schema. Construct directly or with
``dal.hardware.load_hardware``; any invalid field raises ``HardwareModelError`` naming the
key path, the bad value and what is allowed.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields

from dal.config.fields import did_you_mean
from dal.config.nm_pattern import canonical_nm_pattern, nm_pattern_problem
from dal.config.problems import Problem
from dal.config.vocabulary import GRANULARITIES
from dal.formats.qformat import QFormat, get_format
from dal.hardware.errors import HardwareModelError
from dal.hardware.requantizer import REQUANTIZER_KINDS, ROUNDINGS, Requantizer  # noqa: F401 (re-exported)
from dal.hardware.op_classes import (ALL_OP_CLASSES, OP_CLASS_ROLES, OP_CLASSES, RESIZE_MODES, ROLES,
                                     activation_functions)

NARROW_RANGE = ("required", "allowed", "forbidden")
SCALE_CONSTRAINTS = ("any", "power_of_two")  # power_of_two: every scale is exactly 2^k
ACCUMULATOR_OVERFLOW = ("saturate", "wrap")
ENGINE_COMPUTE = ("fp32", "fp16")  # an engine's internal float precision (Engine.compute)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _raise(problems: list[Problem]) -> None:
    if problems:
        raise HardwareModelError(problems)


def _as_tuple(obj, name: str, convert=None) -> None:
    """Store ``obj.name`` as a tuple (a list or a single value is accepted), converting items."""
    value = getattr(obj, name)
    if value is None:
        value = ()
    elif isinstance(value, (str, QFormat)) or not hasattr(value, "__iter__"):
        value = (value,)
    value = tuple(convert(v) if convert else v for v in value)
    object.__setattr__(obj, name, value)


def _formats(obj, name: str, problems: list[Problem]) -> None:
    try:
        _as_tuple(obj, name, get_format)
    except ValueError as e:
        problems.append(Problem(str(e), (name,)))
        object.__setattr__(obj, name, ())


def _names(values) -> str:
    return ", ".join(getattr(v, "name", str(v)) for v in values) or "(none)"


def _scale_constraint(obj, problems: list[Problem]) -> None:
    if obj.scale_constraint not in SCALE_CONSTRAINTS:
        problems.append(Problem(f"{obj.scale_constraint!r} is not allowed (allowed: {', '.join(SCALE_CONSTRAINTS)})",
                                ("scale_constraint",)))


@dataclass(frozen=True)
class Engine:
    """A compute unit: ``matrix`` (MAC array), ``vector`` (SIMD/LUT), ``dsp`` (custom ops).

    ``formats`` is every format the engine computes in; an op on this engine may only use these.
    ``compute``: the precision of its float arithmetic, "fp32" (default) or "fp16" (its float ops
    round operands and results to fp16: FP16 islands, export/SPEC.md §5a "Precision").
    """

    name: str
    description: str = ""
    formats: tuple[QFormat, ...] = ()
    compute: str = "fp32"

    def __post_init__(self):
        problems: list[Problem] = []
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            problems.append(Problem(f"engine name {self.name!r} must be an identifier", ("name",)))
        _formats(self, "formats", problems)
        if self.compute not in ENGINE_COMPUTE:
            problems.append(Problem(f"{self.compute!r} is not allowed (allowed: {', '.join(ENGINE_COMPUTE)})", ("compute",)))
        elif self.compute != "fp32" and self.formats and get_format(self.compute) not in self.formats:
            problems.append(Problem(f"compute: {self.compute} needs {self.compute} in the engine's formats "
                                    f"(its formats: {_names(self.formats)})", ("compute",)))
        _raise(problems)


@dataclass(frozen=True)
class OpSupport:
    """How the hardware runs one op class: on which engine, with which formats per role.

    A role the op class does not have (``weight`` of ``add``, ``input`` of ``embedding``, whose
    input is indices) must be empty; a role it has must list at least one format.
    ``granularities``: the activation granularities this op takes when they differ from
    ``activation_rules.granularities`` (``kv_cache``: ``per_channel`` is one scale per head);
    empty means those of ``activation_rules``. ``grid_formats``: ``grid_sample`` only, and required
    there: the formats its sampling grid may take (export/SPEC.md §5b: dal quantizes it to int16).
    """

    op_class: str
    engine: str
    weight_formats: tuple[QFormat, ...] = ()
    input_formats: tuple[QFormat, ...] = ()
    output_formats: tuple[QFormat, ...] = ()
    granularities: tuple[str, ...] = ()
    grid_formats: tuple[QFormat, ...] = ()

    def __post_init__(self):
        problems: list[Problem] = []
        for role in ROLES:
            _formats(self, f"{role}_formats", problems)
        _formats(self, "grid_formats", problems)
        if (self.op_class == "grid_sample") != bool(self.grid_formats):
            problems.append(Problem("grid_formats is for grid_sample only, and grid_sample needs it (the sampling "
                                    "grid's formats, e.g. [int16])", ("grid_formats",)))
        _as_tuple(self, "granularities")
        bad = [g for g in self.granularities if g not in GRANULARITIES]
        if bad:
            problems.append(Problem(f"{_names(bad)} not allowed; granularities lists {', '.join(GRANULARITIES)}",
                                    ("granularities",)))
        if self.op_class not in OP_CLASS_ROLES:
            problems.append(Problem(f"unknown op class {self.op_class!r}{did_you_mean(self.op_class, ALL_OP_CLASSES)} "
                                    f"(known: {', '.join(ALL_OP_CLASSES)})"))
        else:
            roles = OP_CLASS_ROLES[self.op_class]
            for role in ROLES:
                given = getattr(self, f"{role}_formats")
                if role in roles and not given:
                    problems.append(Problem(f"{self.op_class} has {role}s: list at least one format "
                                            f"in {role}_formats", (f"{role}_formats",)))
                elif role not in roles and given:
                    problems.append(Problem(f"{self.op_class} has no {role}; remove {role}_formats "
                                            f"(roles of {self.op_class}: {', '.join(roles)})",
                                            (f"{role}_formats",)))
        _raise(problems)

    @property
    def roles(self) -> tuple[str, ...]:
        return OP_CLASS_ROLES[self.op_class]

    def formats(self, role: str) -> tuple[QFormat, ...]:
        """Formats allowed for ``role`` ("weight", "input" or "output")."""
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not one of {', '.join(ROLES)}")
        return getattr(self, f"{role}_formats")


@dataclass(frozen=True)
class WeightRules:
    """Constraints on weight quantization parameters, whatever the format."""

    symmetric_required: bool = True
    granularities: tuple[str, ...] = ("per_tensor", "per_channel")
    group_sizes: tuple[int, ...] = ()
    narrow_range: str = "allowed"
    scale_constraint: str = "any"

    def __post_init__(self):
        problems: list[Problem] = []
        _as_tuple(self, "granularities")
        _as_tuple(self, "group_sizes")
        _scale_constraint(self, problems)
        if not isinstance(self.symmetric_required, bool):
            problems.append(Problem(f"expected true or false, got {self.symmetric_required!r}", ("symmetric_required",)))
        bad = [g for g in self.granularities if g not in GRANULARITIES]
        if bad or not self.granularities:
            problems.append(Problem(f"{_names(bad)} not allowed; granularities is a non-empty list of "
                                    f"{', '.join(GRANULARITIES)}", ("granularities",)))
        if any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in self.group_sizes):
            problems.append(Problem(f"group sizes must be positive integers, got {list(self.group_sizes)}", ("group_sizes",)))
        elif ("per_group" in self.granularities) != bool(self.group_sizes):
            problems.append(Problem("list group_sizes exactly when per_group is an allowed granularity", ("group_sizes",)))
        if self.narrow_range not in NARROW_RANGE:
            problems.append(Problem(f"{self.narrow_range!r} is not allowed (allowed: {', '.join(NARROW_RANGE)})", ("narrow_range",)))
        _raise(problems)

    def violations(self, granularity: str, group_size: int | None, symmetric: bool,
                   narrow_range: bool) -> list[str]:
        """What a weight quantizer with these parameters breaks, each with what is allowed."""
        out = []
        if granularity not in self.granularities:
            out.append(f"granularity {granularity} is not supported (allowed: {', '.join(self.granularities)})")
        elif granularity == "per_group" and group_size not in self.group_sizes:
            out.append(f"group_size {group_size} is not supported (allowed: {', '.join(map(str, self.group_sizes))})")
        if self.symmetric_required and not symmetric:
            out.append("asymmetric weights are not supported (set symmetric: true)")
        if self.narrow_range == "required" and not narrow_range:
            out.append("narrow_range is required (set narrow_range: true)")
        if self.narrow_range == "forbidden" and narrow_range:
            out.append("narrow_range is not supported (set narrow_range: false)")
        return out


@dataclass(frozen=True)
class ActivationRules:
    """Constraints on activation (input/output) quantization: symmetric and/or affine."""

    symmetric: bool = True
    affine: bool = True
    granularities: tuple[str, ...] = ("per_tensor",)
    scale_constraint: str = "any"

    def __post_init__(self):
        problems: list[Problem] = []
        _as_tuple(self, "granularities")
        _scale_constraint(self, problems)
        for name in ("symmetric", "affine"):
            if not isinstance(getattr(self, name), bool):
                problems.append(Problem(f"expected true or false, got {getattr(self, name)!r}", (name,)))
        if self.symmetric is False and self.affine is False:
            problems.append(Problem("at least one of symmetric and affine must be true", ("affine",)))
        bad = [g for g in self.granularities if g not in GRANULARITIES]
        if bad or not self.granularities:
            problems.append(Problem(f"{_names(bad)} not allowed; granularities is a non-empty list of "
                                    f"{', '.join(GRANULARITIES)}", ("granularities",)))
        _raise(problems)

    def violations(self, granularity: str, symmetric: bool, granularities: tuple[str, ...] = ()) -> list[str]:
        """What an activation quantizer with these parameters breaks; ``granularities``: those
        of its op when it lists its own (``HardwareModel.activation_granularities``)."""
        out = []
        allowed = granularities or self.granularities
        if granularity not in allowed:
            out.append(f"activation granularity {granularity} is not supported "
                       f"(allowed: {', '.join(allowed)})")
        if symmetric and not self.symmetric:
            out.append("symmetric activations are not supported (set symmetric: false)")
        if not symmetric and not self.affine:
            out.append("affine (zero-point) activations are not supported (set symmetric: true)")
        return out


@dataclass(frozen=True)
class HardwareModel:
    """An NPU: engines, per-op-class formats, quantization rules, requantizer, extras.

    Attributes beyond the sub-dataclasses:
        accumulator_bits: width of the matrix engine accumulator (e.g. 32).
        accumulator_overflow: "saturate" (the exact sum clamps to the accumulator's range) or
            "wrap" (two's complement modulo 2^accumulator_bits).
        shared_scale: op classes whose inputs and output must share one scale and zero point
            (a concat or add that does not requantize).
        channel_alignment: channel counts are padded to a multiple of this on the chip.
        lut_size: entries in the activation lookup table (needed when ``lut_ops`` is set).
        sparse_ops: op classes whose weights may follow ``sparsity_patterns`` (e.g. "2:4").
        fp16_ops: op classes / activation functions the vector engine runs in fp16.
        lut_ops: activation functions run through the lookup table on integer inputs.
        replace_rules_needed: operator replacement rules (dal.replace) this chip needs.
        resize_modes: interpolation modes the resize op supports.
        source: where it was loaded from (not compared).
    """

    name: str
    description: str = ""
    engines: tuple[Engine, ...] = ()
    ops: tuple[OpSupport, ...] = ()
    weight_rules: WeightRules = field(default_factory=WeightRules)
    activation_rules: ActivationRules = field(default_factory=ActivationRules)
    requantizer: Requantizer = field(default_factory=Requantizer)
    accumulator_bits: int = 32
    accumulator_overflow: str = "saturate"
    shared_scale: tuple[str, ...] = ()
    channel_alignment: int = 1
    lut_size: int | None = None
    sparse_ops: tuple[str, ...] = ()
    sparsity_patterns: tuple[str, ...] = ("2:4",)
    fp16_ops: tuple[str, ...] = ()
    lut_ops: tuple[str, ...] = ()
    replace_rules_needed: tuple[str, ...] = ()
    resize_modes: tuple[str, ...] = ()
    cost: object = None  # a dal.hardware.cost.CostModel (the YAML's cost: section), or None
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("engines", "ops", "sparse_ops", "sparsity_patterns", "fp16_ops", "lut_ops",
                     "replace_rules_needed", "resize_modes", "shared_scale"):
            _as_tuple(self, name)
        problems: list[Problem] = []
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            problems.append(Problem(f"name {self.name!r} must be an identifier such as a2000", ("name",)))
        for key, cls in (("weight_rules", WeightRules), ("activation_rules", ActivationRules),
                         ("requantizer", Requantizer)):
            if not isinstance(getattr(self, key), cls):
                problems.append(Problem(f"expected a {cls.__name__}, got {getattr(self, key)!r}", (key,)))
        engines = {}
        for e in self.engines:
            if not isinstance(e, Engine):
                problems.append(Problem(f"expected Engine objects, got {e!r}", ("engines",)))
            elif e.name in engines:
                problems.append(Problem(f"engine {e.name!r} is listed twice", ("engines", e.name)))
            else:
                engines[e.name] = e
        seen = set()
        for op in self.ops:
            if not isinstance(op, OpSupport):
                problems.append(Problem(f"expected OpSupport objects, got {op!r}", ("ops",)))
                continue
            path = ("ops", op.op_class)
            if op.op_class in seen:
                problems.append(Problem(f"op class {op.op_class!r} is listed twice", path))
            seen.add(op.op_class)
            engine = engines.get(op.engine)
            if engine is None:
                problems.append(Problem(f"engine {op.engine!r} is not defined{did_you_mean(op.engine, engines)} "
                                        f"(engines: {', '.join(engines) or '(none)'})", path + ("engine",)))
            elif engine.formats:
                for role in op.roles:
                    extra = [f for f in op.formats(role) if f not in engine.formats]
                    if extra:
                        problems.append(Problem(f"{_names(extra)} not computed by the {engine.name} engine "
                                                f"(its formats: {_names(engine.formats)})",
                                                path + (f"{role}_formats",)))
        for key, lo in (("accumulator_bits", 8), ("channel_alignment", 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                problems.append(Problem(f"expected an integer >= {lo}, got {v!r}", (key,)))
        if self.lut_size is not None and (isinstance(self.lut_size, bool) or not isinstance(self.lut_size, int)
                                          or self.lut_size < 2):
            problems.append(Problem(f"expected an integer >= 2, got {self.lut_size!r}", ("lut_size",)))
        if self.lut_ops and self.lut_size is None:
            problems.append(Problem("lut_ops needs lut_size (number of table entries, e.g. 256)", ("lut_size",)))
        self._check_names(problems, "sparse_ops", seen, "op classes listed under ops")
        patterns = []
        for i, p in enumerate(self.sparsity_patterns):
            problem = nm_pattern_problem(p)
            if problem is not None:
                problems.append(Problem(problem, ("sparsity_patterns", i)))
            else:
                patterns.append(canonical_nm_pattern(p))
        if len(patterns) == len(self.sparsity_patterns):  # stored canonical: patterns compare as text
            object.__setattr__(self, "sparsity_patterns", tuple(patterns))
        self._check_names(problems, "fp16_ops", OP_CLASSES + activation_functions(), "op classes or activation functions")
        self._check_names(problems, "lut_ops", activation_functions(), "activation functions")
        self._check_names(problems, "resize_modes", RESIZE_MODES, "resize modes")
        self._check_names(problems, "shared_scale", OP_CLASSES, "op classes")
        if self.accumulator_overflow not in ACCUMULATOR_OVERFLOW:
            problems.append(Problem(f"{self.accumulator_overflow!r} is not allowed (allowed: "
                                    f"{', '.join(ACCUMULATOR_OVERFLOW)})", ("accumulator_overflow",)))
        if isinstance(self.requantizer, Requantizer) and self.requantizer.kind == "power_of_two" and not (
                self.weight_rules.scale_constraint == self.activation_rules.scale_constraint == "power_of_two"):
            problems.append(Problem("a power_of_two (shift-only) requantizer needs scale_constraint: power_of_two "
                                    "in both weight_rules and activation_rules", ("requantizer", "kind")))
        if "resize" in seen and not self.resize_modes:
            problems.append(Problem("the resize op needs resize_modes (e.g. [nearest])", ("resize_modes",)))
        for i, r in enumerate(self.replace_rules_needed):
            if not isinstance(r, str) or not _NAME.match(r):
                problems.append(Problem(f"{r!r} is not a replacement rule name", ("replace_rules_needed", i)))
        _raise(problems)

    def _check_names(self, problems, key, allowed, what) -> None:
        for i, v in enumerate(getattr(self, key)):
            if v not in allowed:
                problems.append(Problem(f"{v!r} is not allowed{did_you_mean(v, allowed)}; {key} lists "
                                        f"{what} ({', '.join(allowed)})", (key, i)))

    # -- queries -------------------------------------------------------------------------------
    def engine(self, name: str) -> Engine:
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(f"hardware {self.name!r} has no engine {name!r}")

    def op(self, op_class: str) -> OpSupport | None:
        """How ``op_class`` runs on this hardware, or None when the hardware does not run it."""
        for op in self.ops:
            if op.op_class == op_class:
                return op
        return None

    def supports_op(self, op_class: str) -> bool:
        return self.op(op_class) is not None

    def allowed_formats(self, op_class: str, role: str) -> tuple[QFormat, ...]:
        """Formats allowed for ``role`` of ``op_class``; () when the op is not supported."""
        op = self.op(op_class)
        return op.formats(role) if op is not None and role in op.roles else ()

    def supports_sparsity(self, op_class: str, pattern: "str | object" = "2:4") -> bool:
        """True when ``op_class`` takes weights with the N:M ``pattern``; else they stay dense.

        ``pattern`` is text (``"2:4"``, compared in canonical form) or a ``dal.config.NMPattern``;
        one that is not a valid pattern is supported nowhere.
        """
        if nm_pattern_problem(pattern) is not None:
            return False
        return op_class in self.sparse_ops and canonical_nm_pattern(pattern) in self.sparsity_patterns

    def runs_in_fp16(self, name: str) -> bool:
        """True when the op class or activation function ``name`` runs natively in fp16."""
        return name in self.fp16_ops

    def activation_granularities(self, op_class: str) -> tuple[str, ...]:
        """Granularities allowed for the activations (inputs, outputs) of ``op_class``: the op's own
        ``granularities`` when it lists them, else ``activation_rules.granularities``."""
        op = self.op(op_class)
        return (op.granularities if op is not None and op.granularities else None) or \
            self.activation_rules.granularities

    def compute_precision(self, op_class: str) -> str:
        """``compute`` ("fp32" / "fp16") of the engine running ``op_class`` ("fp32": none runs it)."""
        op = self.op(op_class)
        return next((e.compute for e in self.engines if op is not None and e.name == op.engine), "fp32")

    def to_dict(self) -> dict:
        """Plain data in the YAML schema (formats by name); ``load_hardware`` reads it back."""
        def plain(v):
            if isinstance(v, QFormat):
                return v.name
            if hasattr(v, "to_dict"):  # the cost model
                return v.to_dict()
            if isinstance(v, (tuple, list)):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v

        out: dict = {"name": self.name, "description": self.description,
                     "engines": {e.name: {"description": e.description, "formats": plain(e.formats),
                                          **({"compute": e.compute} if e.compute != "fp32" else {})}
                                 for e in self.engines},
                     "ops": {op.op_class: {"engine": op.engine, **{f"{r}_formats": plain(op.formats(r))
                                                                  for r in op.roles},
                                           **({"granularities": list(op.granularities)} if op.granularities else {}),
                                           **({"grid_formats": plain(op.grid_formats)} if op.grid_formats else {})}
                             for op in self.ops}}
        for f in fields(self):
            if f.name in out or f.name == "source":
                continue
            v = getattr(self, f.name)
            if f.name in ("weight_rules", "activation_rules", "requantizer"):
                v = {k: x for k, x in asdict(v).items() if x is not None}
            out[f.name] = plain(v)
        return out
