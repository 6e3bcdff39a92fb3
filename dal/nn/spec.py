"""Build FakeQuantizers from the recipe's validated spec types (``dal.recipe.TensorSpec`` /
``LayerSpec``): dal.nn reads no other kind of spec.

``tensor_spec`` / ``layer_spec`` are shorthands for code and tests that build QAT modules
without a recipe; they return those same validated types (``SimpleTensorSpec`` /
``SimpleLayerSpec`` are their former names). A layer kept in FP16 is written one way, as the
recipe writes it: ``LayerSpec(fallback_fp16=True)`` with no tensor specs; the QAT module then
casts its input, weight, bias and output to FP16 (``FP16_CAST``), as the chip computes it.
"""
from __future__ import annotations

from typing import Optional

from ..formats import PER_TENSOR, Granularity, get_format
from ..quantizer import FakeQuantizer
from ..recipe.spec import LayerSpec, TensorSpec

#: an FP16 cast round trip: what a layer kept in FP16 applies to its input, weight and output
FP16_CAST = TensorSpec.for_role("fp16", "input")


def tensor_spec(format="int8", granularity="per_tensor", axis=None, group_size=None, symmetric=True,
                narrow_range=False, observer="minmax", observer_args=(), learnable=False) -> TensorSpec:
    """A validated ``TensorSpec`` with the defaults of hand-built layers: symmetric, min-max.
    A format without a scale (fp16) gets its only valid settings (per tensor, no observer)."""
    fmt = get_format(format)
    if not fmt.is_scaled:
        return TensorSpec.for_role(fmt, "input")
    return TensorSpec(fmt, granularity, axis, group_size, bool(symmetric) or fmt.is_float8, narrow_range,
                      observer, dict(observer_args), learnable)


def layer_spec(weight=None, input=None, output=None, fallback_fp16=False, sparsity=None) -> LayerSpec:
    """A validated ``LayerSpec``; ``fallback_fp16=True`` ignores the tensor specs (one FP16 form)."""
    if fallback_fp16:
        return LayerSpec(fallback_fp16=True, sparsity=sparsity)
    return LayerSpec(weight=weight, input=input, output=output, sparsity=sparsity)


SimpleTensorSpec = tensor_spec
SimpleLayerSpec = layer_spec


def role_specs(spec: Optional[LayerSpec]) -> tuple[Optional[TensorSpec], Optional[TensorSpec], Optional[TensorSpec]]:
    """``(input, weight, output)`` tensor specs a QAT module builds quantizers from; a layer kept
    in FP16 casts its input, weight and output: the chip writes the FP16 result, and an int8
    quantizer reading an unrounded float32 value instead flips ~5e-4 of its codes
    (export/SPEC.md §6)."""
    if spec is None:
        return None, None, None
    if spec.fallback_fp16:
        return FP16_CAST, FP16_CAST, FP16_CAST
    return spec.input, spec.weight, spec.output


def per_channel_variant(spec: TensorSpec) -> TensorSpec:
    """``spec`` per output channel (the module's natural axis) instead of per group."""
    return TensorSpec(spec.format, "per_channel", None, None, spec.symmetric, spec.narrow_range, spec.observer,
                      spec.observer_args, spec.learnable)


def granularity_of(spec: TensorSpec, default_axis: Optional[int]) -> Granularity:
    """``per_tensor`` / ``per_channel`` / ``per_group`` of a spec, with the role's default axis."""
    if spec.granularity == "per_tensor":
        return PER_TENSOR
    axis = default_axis if spec.axis is None else spec.axis
    if spec.granularity == "per_channel":
        return Granularity(axis=axis)
    return Granularity(axis=axis, block_size=int(spec.group_size))


def make_quantizer(spec: Optional[TensorSpec], default_axis: Optional[int] = None, name: str = "",
                   force_per_tensor: bool = False) -> Optional[FakeQuantizer]:
    """A FakeQuantizer for ``spec`` (None -> None). ``default_axis`` is the channel axis of the
    tensor's role (weights: output channels; group blocks: the reduction axis)."""
    if spec is None:
        return None
    if not isinstance(spec, TensorSpec):
        raise TypeError(f"{name or 'make_quantizer'}: expected a dal.recipe.TensorSpec (dal.nn.tensor_spec builds "
                        f"one), got {type(spec).__name__}")
    fmt = spec.format
    gran = PER_TENSOR if force_per_tensor or not fmt.is_scaled else granularity_of(spec, default_axis)
    observer = spec.observer if spec.observer != "none" else "minmax"
    return FakeQuantizer(fmt, gran, symmetric=spec.symmetric, narrow_range=spec.narrow_range, observer=observer,
                         observer_args=dict(spec.observer_args), learnable=spec.learnable, name=name)
