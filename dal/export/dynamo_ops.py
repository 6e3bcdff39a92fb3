"""Translations that give the dynamo route the nodes the TorchScript route writes.

The dynamo ONNX exporter decomposes some operators before translating them, and the QDQ graph a
deployment compiler sees then differs from the TorchScript route's for no numerical reason:

* ``adaptive_avg_pool2d`` (no torchlib translation) becomes ``ReduceMean``; TorchScript writes
  ``GlobalAveragePool`` for a 1x1 output and ``AveragePool`` (kernel = stride = input / output)
  for an output that divides the input. Here: the same; any other output size is a capture
  failure (the TorchScript exporter refuses it too).
* ``torch.flatten`` (CompositeImplicitAutograd, decomposed by ``run_decompositions`` whatever the
  translation table says) becomes ``Reshape``; TorchScript writes ``Flatten`` when the result is
  2-D. While torch.export traces, :class:`KeepFlatten` sends each ``torch.flatten`` call to
  ``dal::flatten`` (same arguments, same result), translated by torchlib's own ``aten_flatten``
  (``Flatten`` for those cases, ``Reshape`` otherwise).
"""
from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode


@functools.cache
def flatten_op():
    """``torch.ops.dal.flatten.default``: ``torch.flatten(x, start_dim, end_dim)``, registered on first use."""

    @torch.library.custom_op("dal::flatten", mutates_args=())
    def flatten(x: torch.Tensor, start_dim: int, end_dim: int) -> torch.Tensor:
        return torch.flatten(x, start_dim, end_dim).clone()

    @flatten.register_fake
    def _fake(x, start_dim, end_dim):
        return torch.flatten(torch.empty_like(x), start_dim, end_dim).clone()

    return torch.ops.dal.flatten.default


class KeepFlatten(TorchFunctionMode):
    """While ``torch.export`` traces: ``torch.flatten`` / ``Tensor.flatten`` call ``dal::flatten``
    (same arguments, same result), an op no decomposition touches."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.flatten, torch.Tensor.flatten) and args and isinstance(args[0], torch.Tensor) \
                and all(isinstance(a, int) for a in (*args[1:], *kwargs.values())):
            x, rest = args[0], list(args[1:])
            start = rest[0] if rest else kwargs.get("start_dim", 0)
            end = rest[1] if len(rest) > 1 else kwargs.get("end_dim", -1)
            return flatten_op()(x, int(start), int(end))
        return func(*args, **kwargs)


@functools.cache
def translations() -> dict:
    """``{torch op: onnxscript function}`` for the operators of the module docstring."""
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.core import aten_flatten

    def adaptive_avg_pool2d(x, output_size):
        out = [int(s) for s in output_size]
        if all(s == 1 for s in out):
            return op.GlobalAveragePool(x)
        size = [int(d) for d in x.shape[-2:]]
        if any(s % o for s, o in zip(size, out)):
            raise ValueError(f"adaptive_avg_pool2d: output {out} does not divide the input {size}")
        kernel = [s // o for s, o in zip(size, out)]
        return op.AveragePool(x, kernel_shape=kernel, strides=kernel)

    def flatten(x, start_dim: int, end_dim: int):
        return aten_flatten(x, start_dim, end_dim)

    return {torch.ops.aten.adaptive_avg_pool2d.default: adaptive_avg_pool2d, flatten_op(): flatten}
