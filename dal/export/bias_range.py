"""Refuse an export whose int32 bias codes saturate: the layer and its degenerate scale, named.

Why (measured on torchvision's random-weight SSDlite and EfficientNet-B0 in eval mode): with
BatchNorm running statistics that do not describe the activations, the activations shrink layer
after layer (1e-9 ... 1e-20 deep in the network), calibration gives input scales as small, and a
bias ``b`` becomes ``b / (s_in * s_w)`` codes far beyond int32. The QAT model fake-quantizes
the bias with saturation, and the exporter writes those saturated codes, consistently; torch and
onnxruntime (float sums) run the file, but on integer hardware the accumulator plus that bias
overflows int32, which dal.npu reports. The bias *scale* is not wrong (it is the convention
``s_in * s_w``); the numbers are not representable. So the export refuses, per layer, with the
scales, and says what works: calibrate on data the model sees (or train / re-estimate the BN
statistics first), or keep that layer's bias out of int32.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import ExportError

INT32_MAX = 2**31 - 1


def check_bias_codes(proto: onnx.ModelProto) -> None:
    """Raise ExportError listing every Conv / ConvTranspose / Gemm whose int32 bias (a
    DequantizeLinear of an int32 initializer) holds a saturated code (+-(2^31 - 1) or -2^31)."""
    inits = {t.name: t for t in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    offenders = []
    for node in proto.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3 or not node.input[2]:
            continue
        dq = producer.get(node.input[2])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        codes = numpy_helper.to_array(inits[dq.input[0]])
        if codes.dtype != np.int32 or not np.any(np.abs(codes.astype(np.int64)) >= INT32_MAX):
            continue
        bias_scale = numpy_helper.to_array(inits[dq.input[1]]) if dq.input[1] in inits else None
        s_in = _input_scale(node, producer, inits)
        n_sat = int(np.sum(np.abs(codes.astype(np.int64)) >= INT32_MAX))
        offenders.append(f"  {node.name}: {n_sat} of {codes.size} int32 bias codes saturate; input scale s_in = "
                         f"{s_in:.3g}, bias scale s_in*s_w down to {float(np.min(bias_scale)):.3g}"
                         if bias_scale is not None else f"  {node.name}: {n_sat} int32 bias codes saturate")
    if offenders:
        raise ExportError(f"{len(offenders)} layer(s) have biases that do not fit int32 at scale s_in*s_w (the NPU's "
                          "accumulator would overflow). A degenerate input scale comes from calibration in eval mode "
                          "with BatchNorm running statistics that do not describe the data (never set, as in a "
                          "random-init model, or stale): the activations then shrink layer after layer, and so do "
                          "the scales. Set the statistics before calibrating (train, load weights, "
                          "dal.ptq.reestimate_bn, or dal.calibrate(..., bn_statistics='auto') for never-set "
                          "ones), then calibrate on representative data\n" + "\n".join(offenders))


def _input_scale(node, producer: dict, inits: dict) -> float:
    dq = producer.get(node.input[0])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[1] not in inits:
        return float("nan")
    return float(np.min(numpy_helper.to_array(inits[dq.input[1]])))
