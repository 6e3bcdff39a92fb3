"""Shared helpers of the 2:4 + QAT tests (unique module name: imported by the tests).

The oracles here read only arrays and the ONNX file: 2:4 validity is counted with a numpy
reshape, never with dal's own helpers, so a shared bug cannot pass both. The runtimes, the
output LSB and LSB counting are tests/oracles.py.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

import dal
from dal.prepare.state import set_quantizer_state


def max_nonzeros_per_group(a, axis: int) -> int:
    """Largest number of non-zeros in a group of 4 consecutive elements along ``axis``."""
    a = np.asarray(a.detach() if isinstance(a, torch.Tensor) else a)
    assert a.shape[axis] % 4 == 0, f"axis {axis} of {a.shape} is not a multiple of 4"
    return int((np.moveaxis(a != 0, axis, -1).reshape(-1, 4)).sum(axis=1).max())


def engine_weight(mod: nn.Module) -> torch.Tensor:
    """The weight a QAT module's matrix engine multiplies in eval: BN folded, masked, fake
    quantized (what the exporter turns into codes)."""
    w = mod.folded_weight_and_bias()[0] if hasattr(mod, "folded_weight_and_bias") else mod.weight
    with torch.no_grad():
        return mod.quantized_weight(w)


def calibrated_frozen(model: nn.Module, batches, recipe="int8_sparse24", hardware="a2000") -> nn.Module:
    """prepare_qat + calibrate on ``batches`` + freeze every quantizer, eval mode."""
    model = dal.prepare_qat(model, recipe=recipe, hardware=hardware, example_inputs=(batches[0][:1],),
                            quantize_outputs=True)
    dal.calibrate(model, batches, progress=False)
    set_quantizer_state(model, "frozen")
    return model.eval()


def run_npu(proto: onnx.ModelProto, feeds: dict) -> list:
    import dal.npu

    return dal.npu.load(proto, threads=1).run(feeds)


def initializers(proto: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


def weight_codes(proto: onnx.ModelProto) -> dict:
    """{codes initializer: reduction axis} for the weight of every Conv / Gemm / MatMul whose
    weight is a DequantizeLinear of an initializer. The axis is read from the operator, as the
    ONNX spec defines it: Conv W [M, C/g, kH, kW] -> 1; Gemm B -> 1 if transB else 0;
    MatMul B [K, N] -> 0."""
    producers = {o: n for n in proto.graph.node for o in n.output}
    inits = {t.name for t in proto.graph.initializer}
    out = {}
    for n in proto.graph.node:
        if n.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        dq = producers.get(n.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        if n.op_type == "Conv":
            axis = 1
        elif n.op_type == "Gemm":
            trans_b = next((a.i for a in n.attribute if a.name == "transB"), 0)
            axis = 1 if trans_b else 0
        else:
            axis = 0
        out[dq.input[0]] = axis
    return out


def teacher_forced_max_lsb(model: nn.Module, proto: onnx.ModelProto, x: torch.Tensor, run) -> dict:
    """{activation quantizer: max |torch - runtime| in LSB} judged layer by layer: the exporter
    tests' teacher-forced comparison (tests/export_common.py), reduced to one figure per layer."""
    from export_common import teacher_forced_stats

    return {q: s.max_lsb for q, s in teacher_forced_stats(model, proto, x, run).items()}


def npu_sparse_kernel_weights(sess) -> "tuple[set, set]":
    """(codes initializers run by the NPU reference's compressed 2:4 kernel, codes initializers
    of every integer group it runs). Reads the session's plan: fused steps keep the compressed
    weight (``conv_w.sparse`` for Conv, ``lin_sparse`` for Gemm / MatMul)."""
    sparse, fused = set(), set()
    for step in sess.steps:
        if getattr(step, "kind", None) != "fused":
            continue
        codes = sess.graph.producer(step.node.input[1]).input[0]
        fused.add(codes)
        conv_w = getattr(step, "conv_w", None)
        if (conv_w is not None and conv_w.sparse is not None) or getattr(step, "lin_sparse", None) is not None:
            sparse.add(codes)
    return sparse, fused


def mnist_batches(n: int, batch: int, split: str = "train", offset: int = 0) -> list:
    """``n`` images of MNIST (normalized as dal_examples.datasets.mnist_loaders does) in batches."""
    from dal_examples.datasets import load_mnist

    x, y = load_mnist()[split]
    x, y = (x[offset:offset + n] - 0.1307) / 0.3081, y[offset:offset + n]
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]
