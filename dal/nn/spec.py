"""Build FakeQuantizers from a recipe's tensor specs (duck-typed: any object with the fields)."""
from __future__ import annotations

from typing import Optional

from ..formats import PER_TENSOR, Granularity, get_format
from ..quantizer import FakeQuantizer


def granularity_of(spec, default_axis: Optional[int]) -> Granularity:
    """``per_tensor`` / ``per_channel`` / ``per_group`` of a spec, with the role's default axis."""
    kind = getattr(spec, "granularity", "per_tensor") or "per_tensor"
    axis = getattr(spec, "axis", None)
    if kind == "per_tensor":
        return PER_TENSOR
    if kind == "per_channel":
        return Granularity(axis=default_axis if axis is None else axis)
    if kind == "per_group":
        size = getattr(spec, "group_size", None)
        if not size:
            raise ValueError(f"per_group granularity needs a group_size (spec: {spec})")
        return Granularity(axis=default_axis if axis is None else axis, block_size=int(size))
    raise ValueError(f"granularity={kind!r} is not one of per_tensor, per_channel, per_group")


def make_quantizer(spec, default_axis: Optional[int] = None, name: str = "",
                   force_per_tensor: bool = False) -> Optional[FakeQuantizer]:
    """A FakeQuantizer for ``spec`` (None -> None). ``default_axis`` is the channel axis of the
    tensor's role (weights: output channels; group blocks: the reduction axis)."""
    if spec is None:
        return None
    fmt = get_format(spec.format)
    gran = PER_TENSOR if force_per_tensor or not fmt.is_scaled else granularity_of(spec, default_axis)
    args = dict(getattr(spec, "observer_args", ()) or ())
    return FakeQuantizer(fmt, gran, symmetric=bool(getattr(spec, "symmetric", True)),
                         narrow_range=bool(getattr(spec, "narrow_range", False)),
                         observer=getattr(spec, "observer", "minmax") or "minmax", observer_args=args,
                         learnable=bool(getattr(spec, "learnable", False)), name=name)


class SimpleTensorSpec:
    """A minimal tensor spec for code and tests that build QAT modules without a recipe."""

    def __init__(self, format="int8", granularity="per_tensor", axis=None, group_size=None, symmetric=True,
                 narrow_range=False, observer="minmax", observer_args=(), learnable=False):
        self.format, self.granularity, self.axis, self.group_size = format, granularity, axis, group_size
        self.symmetric, self.narrow_range, self.observer = symmetric, narrow_range, observer
        self.observer_args, self.learnable = tuple(dict(observer_args).items()), learnable

    def __repr__(self):
        return f"SimpleTensorSpec({self.format}, {self.granularity})"


class SimpleLayerSpec:
    """A minimal layer spec (weight / input / output tensor specs)."""

    def __init__(self, weight=None, input=None, output=None, fallback_fp16=False, sparsity=None):
        self.weight, self.input, self.output = weight, input, output
        self.fallback_fp16, self.sparsity = fallback_fp16, sparsity
