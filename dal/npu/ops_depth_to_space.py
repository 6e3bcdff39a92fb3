"""DepthToSpace (``nn.PixelShuffle``'s export, export/SPEC.md §5h), node by node: data movement, exact.

For ``x [N, C, H, W]`` and ``b = blocksize`` (ONNX's definition):

    DCR (default): x.reshape(N, b, b, C / b^2, H, W).transpose(0, 3, 4, 1, 5, 2)
    CRD:           x.reshape(N, C / b^2, b, b, H, W).transpose(0, 1, 4, 2, 5, 3)

then ``.reshape(N, C / b^2, H * b, W * b)``. Any element type (codes too).
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError
from .ops_float import op


@op("DepthToSpace")
def _depth_to_space(ctx, ins, a):
    x = np.asarray(ins[0])
    b = int(a.get("blocksize", 0))
    mode = a.get("mode", "DCR")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if x.ndim != 4 or b < 1 or x.shape[1] % (b * b):
        raise NPUError(f"node {ctx.node.name!r} (DepthToSpace): needs a 4-D input whose channels "
                       f"({x.shape[1] if x.ndim > 1 else '-'}) divide by blocksize^2 = {b * b}, got shape {x.shape}")
    if mode not in ("DCR", "CRD"):
        raise NPUError(f"node {ctx.node.name!r} (DepthToSpace): mode {mode!r} is not DCR or CRD")
    n, c, h, w = x.shape
    if mode == "DCR":
        t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return [np.ascontiguousarray(t.reshape(n, c // (b * b), h * b, w * b))]
