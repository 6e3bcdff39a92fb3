"""Benchmark: dal.npu vs onnxruntime on ResNet-18 QDQ (quantize_static, random weights),
1x3x224x224, batch 1, ONE thread, interleaved repetitions, medians; plus the int8 GEMM alone.

Targets (not asserted): <= 1.0x onnxruntime on u8s8, <= 0.35x on s8s8, GEMM >= 100 GOP/s.
Buffers are freshly allocated per run (no THP tuning).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "npu"))


def _gemm_gops(reps=5):
    from dal.npu import kernels
    m, k, n = 256, 2304, 784  # a layer3-sized conv as GEMM
    rng = np.random.default_rng(0)
    a = kernels.PackedA(kernels.to_s16(rng.integers(-128, 128, (m, k)), 0))
    b = kernels.pack_b(kernels.to_s16(rng.integers(0, 256, (k, n)), 0))
    kernels.gemm(a, b, n, 1)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        kernels.gemm(a, b, n, 1)
        ts.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(ts) / 1e9


def main(reps=7):
    import onnxruntime as ort
    import zoo
    import dal.npu as npu

    d = os.path.join(tempfile.gettempdir(), "dal_bench_models")
    os.makedirs(d, exist_ok=True)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    print(f"int8 GEMM (exact, 1 thread, 256x2304x784): {_gemm_gops():.1f} GOP/s "
          f"({_gemm_gops() / 125 * 100:.0f}% of 125)")
    for act in ("u8", "s8"):
        p = zoo.torchvision_qdq("resnet18", d, hw=224, activation=act, per_channel=True)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        o = ort.InferenceSession(p, so, providers=["CPUExecutionProvider"])
        s = npu.load(p, threads=1)
        o.run(None, {"input": x})
        s.run({"input": x})
        tn, to = [], []
        for _ in range(reps):
            t = time.perf_counter(); s.run({"input": x}); tn.append(time.perf_counter() - t)
            t = time.perf_counter(); o.run(None, {"input": x}); to.append(time.perf_counter() - t)
        mn, mo = statistics.median(tn) * 1e3, statistics.median(to) * 1e3
        print(f"resnet18 224 {act}s8 per-channel: dal.npu {mn:.1f} ms, onnxruntime {mo:.1f} ms, "
              f"ratio {mn / mo:.2f}x")


if __name__ == "__main__":
    main()
