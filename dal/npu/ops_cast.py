"""CastLike and Round, node by node (the rest of the cast family is ops_float's Cast).

    CastLike(x, like) = Cast(x, to=element type of like, saturate)   (ONNX 15+, saturate 19+)
    Round(x)          = round half to even, in the tensor's own type (exact)

CastLike delegates to the registered Cast, so the two can never disagree; element types dal
does not claim (int2, uint2, float4e2m1, float8e8m0) are refused by tensors.np_dtype.
"""
from __future__ import annotations

import numpy as np

from .errors import UnsupportedNode
from .ops_float import OPS, op
from .tensors import is_float


@op("CastLike")
def _cast_like(ctx, ins, a):
    from onnx import helper
    from .tensors import np_dtype
    x, like = ins[0], ins[1]
    try:
        to = helper.np_dtype_to_tensor_dtype(np.asarray(like).dtype)
    except Exception:
        raise UnsupportedNode(ctx.node, [str(x.dtype), str(like.dtype)], "CastLike target type") from None
    np_dtype(to, ctx.node)  # refuses the types dal does not claim, naming the node
    return OPS["Cast"](ctx, [x], {"to": to, "saturate": a.get("saturate", 1)})


@op("Round")
def _round(ctx, ins, a):
    x = ins[0]
    if not is_float(x):
        raise UnsupportedNode(ctx.node, [str(x.dtype)], "Round expects a float tensor")
    return [np.rint(x)]
