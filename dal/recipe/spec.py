"""What a recipe asks for one tensor (``TensorSpec``) and for one layer (``LayerSpec``).

Both are frozen and validated on construction; invalid values raise ``RecipeError`` naming
the field, the value and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dal.config.nm_pattern import canonical_nm_pattern, nm_pattern_problem
from dal.config.problems import Problem
from dal.config.vocabulary import GRANULARITIES
from dal.formats.qformat import QFormat, get_format
from dal.recipe.errors import RecipeError

OBSERVERS = ("minmax", "moving_average", "percentile", "kl", "mse", "none")


def check_sparsity(pattern: Any) -> str | None:
    """Problem text for an N:M pattern such as "2:4", or None when it is valid.

    The one rule of ``dal.config.nm_pattern`` (``1 <= N < M <= 16``), which ``dal.sparsity``
    applies too, so what a recipe accepts is what prepare can do.
    """
    return nm_pattern_problem(pattern)


def canonical_sparsity(obj, problems: list[Problem]) -> None:
    """Check ``obj.sparsity`` (None or a pattern); store its canonical text or record a problem."""
    if obj.sparsity is None:
        return
    problem = check_sparsity(obj.sparsity)
    if problem is not None:
        problems.append(Problem(problem, ("sparsity",)))
    else:
        object.__setattr__(obj, "sparsity", canonical_nm_pattern(obj.sparsity))


def role_defaults(fmt: QFormat, role: str) -> dict:
    """Field values a spec gets when the recipe names only its format.

    - formats without a scale (fp16, bf16, fp32): a cast, per_tensor, observer "none";
    - weights: per_channel (axis None = the module's output-channel axis), symmetric,
      observer "minmax";
    - inputs / outputs: per_tensor, affine (symmetric for fp8, which has no zero point),
      observer "moving_average".
    """
    if not fmt.is_scaled:
        return dict(granularity="per_tensor", symmetric=True, observer="none")
    if role == "weight":
        return dict(granularity="per_channel", symmetric=True, observer="minmax")
    return dict(granularity="per_tensor", symmetric=fmt.is_float8, observer="moving_average")


@dataclass(frozen=True)
class TensorSpec:
    """How to quantize one tensor (a weight, the inputs or the output of a layer).

    Attributes:
        format: the ``QFormat`` (a name such as "int8" is converted).
        granularity: "per_tensor", "per_channel" (one scale per index of ``axis``),
            "per_group" (blocks of ``group_size`` consecutive elements along ``axis``, the ONNX
            blocked-quantization meaning) or, for activations only, "per_token" (one scale per
            row of the last axis, computed from each tensor at run time: dynamic; only on
            hardware whose ``activation_rules.granularities`` list it).
        axis: the channel / blocked axis; None = the module's natural one (output channels for
            per_channel, input channels for per_group).
        group_size: block size, required exactly for per_group.
        symmetric: zero point fixed at 0 (required by fp8 formats).
        narrow_range: integer codes use [qmin + 1, qmax] (e.g. [-127, 127]); integers only.
        observer: how ranges are measured: minmax, moving_average, percentile, kl, mse, or
            "none" for formats without a scale (fp16).
        observer_args: extra observer arguments as sorted (name, value) pairs.
        learnable: scale learned during training (LSQ).
    """

    format: QFormat
    granularity: str = "per_tensor"
    axis: int | None = None
    group_size: int | None = None
    symmetric: bool = False
    narrow_range: bool = False
    observer: str = "minmax"
    observer_args: tuple[tuple[str, Any], ...] = ()
    learnable: bool = False

    def __post_init__(self):
        problems: list[Problem] = []

        def bad(key, msg):
            problems.append(Problem(msg, (key,)))

        if not isinstance(self.format, QFormat):
            try:
                object.__setattr__(self, "format", get_format(self.format))
            except ValueError as e:
                raise RecipeError(Problem(str(e), ("format",))) from None
        if isinstance(self.observer_args, dict):
            object.__setattr__(self, "observer_args", tuple(sorted(self.observer_args.items())))
        fmt = self.format
        if self.granularity not in GRANULARITIES:
            bad("granularity", f"{self.granularity!r} is not allowed (allowed: {', '.join(GRANULARITIES)})")
        if self.axis is not None and (isinstance(self.axis, bool) or not isinstance(self.axis, int)):
            bad("axis", f"expected an integer or null, got {self.axis!r}")
        if self.granularity == "per_group":
            if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
                bad("group_size", f"per_group needs group_size, a positive integer; got {self.group_size!r}")
        elif self.granularity == "per_token" and self.axis is not None:
            bad("axis", "per_token scales are one per row of the last axis; remove axis")
        elif self.group_size is not None:
            bad("group_size", f"group_size is only for granularity per_group (granularity is {self.granularity}); "
                              "remove it or set granularity: per_group")
        for key in ("symmetric", "narrow_range", "learnable"):
            if not isinstance(getattr(self, key), bool):
                bad(key, f"expected true or false, got {getattr(self, key)!r}")
        if self.observer not in OBSERVERS:
            bad("observer", f"{self.observer!r} is not allowed (allowed: {', '.join(OBSERVERS)})")
        if not (isinstance(self.observer_args, tuple)
                and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in self.observer_args)):
            bad("observer_args", f"expected (name, value) pairs, got {self.observer_args!r}")
        if fmt.is_scaled:
            if self.observer == "none":
                bad("observer", f"{fmt.name} has a scale, so it needs an observer "
                                f"({', '.join(o for o in OBSERVERS if o != 'none')})")
        else:
            if self.granularity != "per_tensor":
                bad("granularity", f"{fmt.name} is a plain cast without a scale; granularity must be per_tensor")
            if self.observer != "none" or self.observer_args:
                bad("observer", f"{fmt.name} is a plain cast without a scale; use observer: none and no observer_args")
            if self.learnable:
                bad("learnable", f"{fmt.name} has no scale to learn; set learnable: false")
        if fmt.is_float8 and not self.symmetric:
            bad("symmetric", f"{fmt.name} has no zero point; set symmetric: true")
        if self.narrow_range and not fmt.is_integer:
            bad("narrow_range", f"narrow_range applies to integer formats only, not {fmt.name}")
        if problems:
            raise RecipeError(problems)

    @classmethod
    def for_role(cls, fmt, role: str, **overrides) -> "TensorSpec":
        """A spec with the defaults of ``role_defaults`` for ``role``, overridden by keywords."""
        fmt = get_format(fmt)
        return cls(fmt, **{**role_defaults(fmt, role), **overrides})

    def to_dict(self) -> dict:
        """Every field, formats by name (the YAML schema of a spec)."""
        out: dict = {"format": self.format.name, "granularity": self.granularity}
        if self.axis is not None:
            out["axis"] = self.axis
        if self.group_size is not None:
            out["group_size"] = self.group_size
        out.update(symmetric=self.symmetric, narrow_range=self.narrow_range, observer=self.observer)
        if self.observer_args:
            out["observer_args"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.observer_args}
        out["learnable"] = self.learnable
        return out

    def describe(self) -> str:
        """Short text for reports: ``int8 per_channel symmetric``."""
        parts = [self.format.name]
        if self.format.is_scaled:
            parts.append(self.granularity + (f"({self.group_size})" if self.group_size else ""))
            parts.append("symmetric" if self.symmetric else "affine")
        return " ".join(parts)


@dataclass(frozen=True)
class LayerSpec:
    """What the recipe asks for one layer: the result of ``Recipe.resolve``.

    Attributes:
        weight, input, output: specs for the roles the layer's op class has (None = leave
            that tensor in float).
        fallback_fp16: keep the whole layer in FP16 (then all three specs are None).
        sparsity: N:M weight sparsity such as "2:4", or None.
        replace: names of operator replacement rules to apply to this layer.
        rule_index: index in ``Recipe.rules`` of the rule that matched.
        rule_source: where that rule was written, ``"file.yaml:line"``.
    """

    weight: TensorSpec | None = None
    input: TensorSpec | None = None
    output: TensorSpec | None = None
    fallback_fp16: bool = False
    sparsity: str | None = None
    replace: tuple[str, ...] = ()
    rule_index: int = -1
    rule_source: str = ""

    def __post_init__(self):
        problems = []
        for role in ("weight", "input", "output"):
            v = getattr(self, role)
            if v is not None and not isinstance(v, TensorSpec):
                problems.append(Problem(f"expected a TensorSpec or None, got {v!r}", (role,)))
        if self.fallback_fp16 and any(getattr(self, r) is not None for r in ("weight", "input", "output")):
            problems.append(Problem("a layer kept in FP16 has no weight/input/output specs", ("fallback_fp16",)))
        canonical_sparsity(self, problems)
        object.__setattr__(self, "replace", tuple(self.replace))
        if problems:
            raise RecipeError(problems)

    @property
    def quantized(self) -> bool:
        """True when at least one tensor of the layer is quantized."""
        return any(getattr(self, r) is not None for r in ("weight", "input", "output"))
