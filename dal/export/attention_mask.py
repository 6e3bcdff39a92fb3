"""Attention masks of Hugging Face encoders at the graph boundary: a float additive input.

transformers turns a 2-D padding mask (``[B, L]``, 1 = token, 0 = padding) into the attention
bias inside ``forward`` (``transformers.masking_utils``): it branches in Python on
``padding_mask.all()`` and, traced, computes the bias with int64 index arithmetic
(``LessOrEqual``, ``GreaterOrEqual``, ``And``) that an NPU does not run. A mask that is already
4-D is used as given. So the deployable form is the bias itself, a float graph input::

    bias[b, 0, 0, j] = 0                       where mask[b, j] == 1 (attended)
                     = finfo(float32).min      where mask[b, j] == 0 (padding)

added to the attention scores before the softmax (export/SPEC.md, "Attention-mask input").
:func:`additive_attention_mask` builds it; :func:`check_attention_mask` refuses a 2-D mask
handed to ``dal.export_onnx`` with an error that says so.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..replace.hf_attention import hf_config_of
from .errors import ExportError


def additive_attention_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float additive bias ``[B, 1, 1, L]`` of a 2-D padding mask ``[B, L]`` (1 or True = attend).

    ``out[b, 0, 0, j] = 0`` where ``mask[b, j]`` is nonzero, ``torch.finfo(dtype).min`` where it
    is 0: transformers' own bias (``eager_mask``), which its models add to the attention scores
    unchanged when the mask is 4-D, so ``model(ids, additive_attention_mask(mask))`` computes what
    ``model(ids, mask)`` does, and exports as a float input with no int64 mask arithmetic.

    Example:
        >>> dal.export_onnx(model, (ids, additive_attention_mask(mask)), "bert.onnx")
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        got = f"a tensor of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"additive_attention_mask: mask must be a 2-D [batch, length] padding mask, got {got}")
    if not dtype.is_floating_point:
        raise ValueError(f"additive_attention_mask: dtype must be a float dtype, got {dtype}")
    attend = mask != 0
    bias = torch.zeros(attend.shape, dtype=dtype, device=mask.device).masked_fill_(~attend, torch.finfo(dtype).min)
    return bias[:, None, None, :]


def check_attention_mask(model: nn.Module, args: tuple) -> None:
    """Refuse a 2-D ``attention_mask`` given to a Hugging Face model's export (see the module doc).

    Binds ``args`` to ``model.forward``'s parameters; when the one named ``attention_mask`` is a
    2-D tensor and the model is a transformers model (its ``config`` has ``_attn_implementation``),
    raises ExportError naming the argument and telling what to pass instead. Anything else passes.
    """
    if hf_config_of(model) is None:
        return
    try:
        bound = inspect.signature(model.forward).bind_partial(*args)
    except (TypeError, ValueError):
        return
    mask = bound.arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        position = list(bound.arguments).index("attention_mask")
        raise ExportError(
            f"{type(model).__name__}: example input {position} is attention_mask, a 2-D {mask.dtype} padding mask "
            f"{tuple(mask.shape)}; transformers turns it into the attention bias with a Python branch on its values "
            "and int64 compare arithmetic (LessOrEqual, GreaterOrEqual) that the NPU does not run. Pass the bias "
            "itself, a float [B, 1, 1, L] input: dal.export.additive_attention_mask(mask) (0 where attended, "
            "finfo(float32).min where padded), to export_onnx and to verify alike, or no mask for unpadded input "
            "(export/SPEC.md, 'Attention-mask input').")
