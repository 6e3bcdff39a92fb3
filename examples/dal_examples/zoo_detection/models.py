"""A small FPN detector (CenterNet-style head) and an FPN segmenter for the MNIST scenes.

Both are written so that ``torch.fx`` traces them whole and every op is one an int8 NPU runs:
Conv+BN+ReLU blocks (BN folded by ``prepare_qat``), nearest 2x upsampling (exact on codes) and
``+`` (the FPN's top-down sum). No list of features is iterated and no data-dependent
control flow is used, so no functional op hides from the capture. The exported file is
tensor in, raw head tensors out; decoding, NMS and argmax run on the host in float
(dal_examples.zoo_detection.heads), identically for torch and the NPU reference.

Backbone strides: stem /2, c2 /4, c3 /8, c4 /16. The FPN sums 1x1 laterals top-down.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 10
STRIDE = 4  # the detector's output grid: one cell per 4x4 pixels


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    """3x3 conv (no bias), BatchNorm, ReLU: the block the NPU runs as one fused int8 conv."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU())


class TinyFPN(nn.Module):
    """Backbone plus top-down FPN; returns p4 (stride 4), or p2 (stride 2) with ``with_p2``.

    ``p3 = lat3(c3) + up(lat4(c4))``, ``p4 = smooth4(lat2(c2) + up(p3))`` (stride 4), and
    ``p2 = smooth2(lat1(stem) + up(p4))`` (stride 2), where ``up`` is nearest 2x.
    """

    def __init__(self, width: int = 16, with_p2: bool = False):
        super().__init__()
        w = width
        self.with_p2 = with_p2
        self.stem = conv_bn_relu(1, w, 2)
        self.c2 = nn.Sequential(conv_bn_relu(w, 2 * w, 2), conv_bn_relu(2 * w, 2 * w))
        self.c3 = nn.Sequential(conv_bn_relu(2 * w, 4 * w, 2), conv_bn_relu(4 * w, 4 * w))
        self.c4 = nn.Sequential(conv_bn_relu(4 * w, 4 * w, 2), conv_bn_relu(4 * w, 4 * w))
        self.lat4 = nn.Conv2d(4 * w, 2 * w, 1)
        self.lat3 = nn.Conv2d(4 * w, 2 * w, 1)
        self.lat2 = nn.Conv2d(2 * w, 2 * w, 1)
        self.smooth4 = conv_bn_relu(2 * w, 2 * w)
        if with_p2:
            self.lat1 = nn.Conv2d(w, 2 * w, 1)
            self.smooth2 = conv_bn_relu(2 * w, w)

    def forward(self, x):
        s = self.stem(x)
        c2 = self.c2(s)
        c3 = self.c3(c2)
        c4 = self.c4(c3)
        p3 = self.lat3(c3) + F.interpolate(self.lat4(c4), scale_factor=2.0, mode="nearest")
        p4 = self.smooth4(self.lat2(c2) + F.interpolate(p3, scale_factor=2.0, mode="nearest"))
        if not self.with_p2:
            return p4
        return self.smooth2(self.lat1(s) + F.interpolate(p4, scale_factor=2.0, mode="nearest"))


class DigitDetector(nn.Module):
    """CenterNet-style detector: image [B, 1, S, S] -> (heat [B, 10, S/4, S/4] logits,
    ltrb [B, 4, S/4, S/4] box edge distances from each cell centre, in cells).

    A digit is detected at the cell holding its box centre; the box is
    ``(cx - l, cy - t, cx + r, cy + b) * STRIDE`` with ``(cx, cy)`` the cell centre.
    """

    def __init__(self, width: int = 16, num_classes: int = NUM_CLASSES):
        super().__init__()
        w = 2 * width
        self.fpn = TinyFPN(width)
        self.heat_head = nn.Sequential(conv_bn_relu(w, w), nn.Conv2d(w, num_classes, 1))
        self.box_head = nn.Sequential(conv_bn_relu(w, w), nn.Conv2d(w, 4, 1))
        # Prior 0.1 per cell and class (CenterNet): the focal loss starts near its optimum for
        # the background, which is almost every cell.
        nn.init.constant_(self.heat_head[1].bias, -2.19)

    def forward(self, x):
        p4 = self.fpn(x)
        return self.heat_head(p4), self.box_head(p4)


class DigitSegmenter(nn.Module):
    """FPN segmenter: image [B, 1, S, S] -> logits [B, 11, S, S] (0 background, 1 + digit).

    The stride-2 FPN output is upsampled (nearest 2x, exact on codes) before the 1x1
    classifier, so the whole model, full-resolution logits included, is the exported file.
    """

    def __init__(self, width: int = 16, num_classes: int = NUM_CLASSES + 1):
        super().__init__()
        self.fpn = TinyFPN(width, with_p2=True)
        self.refine = conv_bn_relu(width, width)
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x):
        return self.head(F.interpolate(self.refine(self.fpn(x)), scale_factor=2.0, mode="nearest"))
