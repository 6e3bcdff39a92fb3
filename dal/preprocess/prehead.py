"""PreHead: the input pipeline (uint8 -> float, layout, channel order, /255, mean/std) as a module.

A board's camera or decoder hands the NPU raw ``uint8`` pixels, often NHWC and sometimes BGR,
while training fed the network normalized float NCHW tensors. Putting the normalization into the
model makes the exported ONNX take what the board delivers:

    uint8 [N,H,W,C] -> Cast(float) -> Transpose -> Gather(channels) -> Div(1/scale) -> Sub(mean) -> Div(std)
        -> the model, whose first quantizer (its first layer's input quantizer) makes the
           integer codes the NPU computes with.

Exactness: by default the arithmetic mirrors the usual training transform op for op
(``x / 255`` as torchvision's ``ToTensor``, then ``(x - mean) / std`` as ``Normalize``), so the
pre-head reproduces the normalized floats of that pipeline bit for bit, in torch and in
onnxruntime (float32 IEEE division and subtraction are exact-rounded everywhere). ``fused=True``
instead computes one ``x * a + b`` per channel (a = scale / std, b = -mean / std): two ops
fewer on the board, but it may round differently from the pipeline in the last bit, which can
move the first quantizer's code by one on rare pixels.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

_ORDERS = ("RGB", "BGR")
_LAYOUTS = ("NCHW", "NHWC")


def _per_channel(values, channels: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float32).flatten()
    if t.numel() == 1:
        t = t.repeat(channels)
    if t.numel() != channels:
        raise ValueError(f"with_prehead: {what} has {t.numel()} values but channels={channels}")
    return t.reshape(1, channels, 1, 1)


class PreHead(nn.Module):
    """``uint8`` (or float holding integer pixel values) in, the model's normalized input out.

    Args:
        mean, std: per channel (or one value), in the channel order the model was trained with
            (``model_channel_order``), in the units *after* ``scale`` (ImageNet:
            ``mean=(0.485, 0.456, 0.406)`` with ``scale=1/255``).
        scale: pixel scale applied first (``1/255`` like ``ToTensor``). When ``1/scale`` is an
            integer the pre-head divides by it (``ToTensor`` divides by 255; multiplying by the
            float32 ``1/255`` rounds differently for some pixels).
        channel_order: the order of the channels the exported model *receives* ("RGB"/"BGR").
        model_channel_order: the order the model was trained with; channels are reversed when
            the two differ.
        layout: "NCHW" or "NHWC" for the raw input (the output is always NCHW).
        fused: compute ``x * a + b`` instead of the op-for-op mirror (see the module docstring).
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], scale: float = 1 / 255,
                 channel_order: str = "RGB", model_channel_order: str = "RGB", layout: str = "NCHW",
                 channels: Optional[int] = None, fused: bool = False):
        super().__init__()
        channel_order, model_channel_order, layout = channel_order.upper(), model_channel_order.upper(), layout.upper()
        if channel_order not in _ORDERS or model_channel_order not in _ORDERS:
            raise ValueError(f"with_prehead: channel orders must be one of {_ORDERS}, got "
                             f"{channel_order!r} / {model_channel_order!r}")
        if layout not in _LAYOUTS:
            raise ValueError(f"with_prehead: layout={layout!r} is not one of {_LAYOUTS}")
        if not scale > 0:
            raise ValueError(f"with_prehead: scale={scale} must be > 0")
        n = channels or max(len(torch.as_tensor(mean).flatten()), len(torch.as_tensor(std).flatten()))
        self.channel_order, self.model_channel_order, self.layout = channel_order, model_channel_order, layout
        self.fused = fused
        self.scale = float(scale)
        inv = 1.0 / self.scale
        # Divide by an integer divisor (255) exactly like ToTensor; otherwise multiply.
        self.divisor = float(round(inv)) if abs(inv - round(inv)) < 1e-6 * inv else None
        mean_t, std_t = _per_channel(mean, n, "mean"), _per_channel(std, n, "std")
        if bool((std_t <= 0).any()):
            raise ValueError(f"with_prehead: std must be > 0, got {std_t.flatten().tolist()}")
        self.register_buffer("mean", mean_t)
        self.register_buffer("std", std_t)
        self.register_buffer("mul", (self.scale / std_t.double()).float())
        self.register_buffer("add", (-mean_t.double() / std_t.double()).float())
        swap = channel_order != model_channel_order
        if swap and n != 3:
            raise ValueError(f"with_prehead: reordering {channel_order} -> {model_channel_order} needs 3 channels, got {n}")
        self.register_buffer("channel_index", torch.tensor([2, 1, 0]) if swap else torch.empty(0, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        if self.layout == "NHWC":
            x = x.permute(0, 3, 1, 2)
        if self.channel_index.numel():
            x = torch.index_select(x, 1, self.channel_index)
        if self.fused:
            return x * self.mul + self.add
        x = x / self.divisor if self.divisor is not None else x * self.scale
        return (x - self.mean) / self.std

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Alias of ``forward``: the training-pipeline transform, usable in a DataLoader."""
        return self.forward(x)

    def extra_repr(self) -> str:
        return (f"layout={self.layout}, channel_order={self.channel_order}->{self.model_channel_order}, "
                f"scale={self.scale:.6g}, mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()}"
                + (", fused" if self.fused else ""))


class WithPreHead(nn.Module):
    """``model(prehead(x))``: a raw-pixel model. ``.model`` is the normalized-input model, so
    training can keep feeding normalized floats to it while export takes the whole."""

    def __init__(self, prehead: PreHead, model: nn.Module):
        super().__init__()
        self.prehead = prehead
        self.model = model

    def forward(self, x: torch.Tensor):
        return self.model(self.prehead(x))


def with_prehead(model: nn.Module, mean: Sequence[float], std: Sequence[float], scale: float = 1 / 255,
                 channel_order: str = "RGB", layout: str = "NCHW", model_channel_order: str = "RGB",
                 fused: bool = False) -> WithPreHead:
    """Wrap ``model`` (float or QAT, usually after ``prepare_qat`` and calibration on normalized
    inputs) so that its forward takes raw pixels: ``uint8`` (or float integer values), laid out
    as ``layout``, channels in ``channel_order``.

    The wrapped model shares ``model``'s parameters and quantizers; ``dal.export_onnx(wrapped,
    (x_uint8,), path)`` writes a graph whose input is ``uint8``, followed by ``Cast`` and the
    normalization, then the first QuantizeLinear.

    Example::

        qat = dal.prepare_qat(model, "int8_balanced", "a2000", example_inputs=(x_norm,))
        dal.calibrate(qat, loader); train(qat)
        raw = dal.preprocess.with_prehead(qat, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                                          scale=1 / 255, channel_order="BGR", layout="NHWC")
        dal.export_onnx(raw, (torch.zeros(1, 224, 224, 3, dtype=torch.uint8),), "model.onnx")
    """
    head = PreHead(mean, std, scale=scale, channel_order=channel_order, model_channel_order=model_channel_order,
                   layout=layout, fused=fused)
    return WithPreHead(head, model)
