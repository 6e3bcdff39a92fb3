"""Test models the NPU reference is checked on, built with tools dal did not write.

``quantize_static`` (onnxruntime) QDQ exports of torchvision CNNs with random weights, and
small graphs built with ``onnx.helper``. Nothing here imports dal outside ``dal.npu``.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np


class _RandomReader:
    """Calibration data reader for quantize_static: a few random batches."""

    def __init__(self, name, shape, n=3, seed=0):
        rng = np.random.default_rng(seed)
        self._it = iter([{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)])

    def get_next(self):
        return next(self._it, None)


def export_torchvision(arch: str, path: str, hw: int = 64, seed: int = 0) -> str:
    """Export torchvision ``arch`` (random weights, eval) to float ONNX at 1x3xhwxhw."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)(weights=None).eval()
    x = torch.randn(1, 3, hw, hw)
    with torch.no_grad():
        torch.onnx.export(model, (x,), path, dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"])
    return path


def quantize_qdq(float_path: str, out_path: str, *, activation: str = "u8",
                 per_channel: bool = True, shape=(1, 3, 64, 64)) -> str:
    """quantize_static in QDQ format. activation "u8" -> U8S8, "s8" -> S8S8."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out_path + ".pre.onnx"
    try:
        quant_pre_process(float_path, pre, skip_symbolic_shape=True)
        src = pre
    except Exception:  # pre-processing is an optimisation only
        src = float_path
    quantize_static(
        src, out_path, _RandomReader("input", shape),
        quant_format=QuantFormat.QDQ, per_channel=per_channel,
        activation_type=QuantType.QUInt8 if activation == "u8" else QuantType.QInt8,
        weight_type=QuantType.QInt8)
    if os.path.exists(pre):
        os.remove(pre)
    return out_path


def torchvision_qdq(arch: str, directory: str | None = None, *, hw: int = 64,
                    activation: str = "u8", per_channel: bool = True) -> str:
    """Float export + quantize_static, cached by name in ``directory``."""
    directory = directory or tempfile.gettempdir()
    name = f"{arch}_{hw}_{activation}_{'pc' if per_channel else 'pt'}.qdq.onnx"
    out = os.path.join(directory, name)
    if not os.path.exists(out):
        fp = os.path.join(directory, f"{arch}_{hw}.float.onnx")
        if not os.path.exists(fp):
            # Written aside and renamed: another xdist worker may be reading this shared cache
            # (a half-written file failed to parse there).
            tmp_fp = fp + f".{os.getpid()}.tmp.onnx"
            export_torchvision(arch, tmp_fp, hw)
            os.replace(tmp_fp, fp)
        tmp = out + f".{os.getpid()}.tmp.onnx"
        quantize_qdq(fp, tmp, activation=activation, per_channel=per_channel,
                     shape=(1, 3, hw, hw))
        os.replace(tmp, out)
    return out
