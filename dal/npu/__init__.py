"""dal.npu -- the NPU reference runtime: an independent executor of QDQ ONNX files.

It reads only the ONNX file (scales, zero points, element types, ``dal.*`` metadata) and
imports nothing from the rest of dal. Integer groups (DQ -> Conv/Gemm/MatMul [-> Relu/Clip]
-> Q) run on exact int32 C++ kernels built lazily on first use (dal/npu/csrc); everything else
runs node by node with ONNX float semantics. See README.md for the numeric contract.

    import dal.npu
    outs = dal.npu.run("model.onnx", {"input": x})
    sess = dal.npu.load("model.onnx"); outs, values = sess.run(feed, return_intermediates=True)
"""
from __future__ import annotations

from .errors import NPUError, UnsupportedNode

__all__ = ["run", "load", "Session", "UnsupportedNode", "NPUError", "info"]


def __getattr__(name):  # lazy: importing dal.npu loads neither onnx nor torch
    if name in ("run", "load", "Session"):
        from . import session
        return getattr(session, name)
    if name == "info":
        from .dispatch import info
        return info
    raise AttributeError(f"module 'dal.npu' has no attribute {name!r}")
