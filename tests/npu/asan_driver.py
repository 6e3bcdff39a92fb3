"""Driver for `make -f mk/asan.mk asan`: runs every C++ kernel of an AddressSanitizer build
on edge sizes, on small test models and on the fuzz corpus (tests/npu/fuzz_corpus.py, 12
cases per mutation kind; `make -f mk/asan.mk asan ASAN_FUZZ=N` for more). Exit 0 means ASan found nothing."""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    import torch
    from dal.npu import build, kernels
    from dal.npu.sparse import compress_rows
    lib = build.kernels(sanitize=True)
    build.kernels = lambda sanitize=False: lib  # every wrapper below uses the ASan build
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 1, 1), (3, 7, 5), (5, 33, 23), (4, 64, 24), (9, 130, 49), (1, 2, 100)]:
        a, b = rng.integers(-255, 256, (m, k)), rng.integers(-255, 256, (k, n))
        assert np.array_equal(kernels.matmul_s16(kernels.to_s16(a, 0), kernels.to_s16(b, 0), 2).numpy(), a @ b)
        if k % 4 == 0:
            w = a.reshape(m, k // 4, 4).copy()
            w[..., :2] = 0
            w = w.reshape(m, k)
            v, p = compress_rows(w)
            bp = torch.from_numpy(np.pad(b, ((0, 0), (0, (-n) % 16))).astype(np.int16))
            assert np.array_equal(lib.sparse24_gemm_s16(torch.from_numpy(v), torch.from_numpy(p), bp, n, 2).numpy(), w @ b)
    acc = rng.integers(-2**30, 2**30, (3, 37)).astype(np.int32)
    kernels.requant_float(acc, np.full(3, 1e-5), np.ones(3, np.float32), np.float32(0.1), 0, -128, 127, 2)
    kernels.requant_fixed(acc, np.full(3, 1 << 30), np.full(3, 40), 0, -128, 127, "half_even", 2)
    import graphs
    import dal.npu as npu
    for i, (mod, shape) in enumerate([(graphs.conv_model(seed=1, group=2), (1, 8, 12, 12)),
                                      (graphs.conv_model(seed=2, group=8), (1, 8, 12, 12)),
                                      (graphs.conv_model(seed=3, stride=(2, 1), pads=(0, 2, 1, 0)), (1, 8, 12, 12)),
                                      (graphs.mixed_model(seed=0), (1, 4, 16, 16)),
                                      (graphs.linear_model(seed=0, op="MatMul"), (5, 40)),
                                      # fused qconv: implicit (C >= 16) and explicit patch paths,
                                      # odd sizes, O not a multiple of 16, 5x5 stride 3 dilation 2
                                      (graphs.conv_model(seed=4, cin=17, cout=33, hw=11, k=5, stride=(3, 2),
                                                         dilation=(1, 2), pads=(3, 0, 1, 2)), (1, 17, 11, 11)),
                                      (graphs.conv_model(seed=5, cin=3, cout=64, hw=30, k=7, stride=(2, 2),
                                                         pads=(3, 3, 3, 3)), (1, 3, 30, 30)),
                                      (graphs.conv_model(seed=6, cin=64, cout=1, hw=5, k=1, pads=(0, 0, 0, 0)), (1, 64, 5, 5)),
                                      (graphs.linear_model(seed=1, op="Gemm", m=7, k=33, n=1000), (7, 33))]):
        npu.run(mod, {"x": rng.standard_normal(shape).astype(np.float32)})
        npu.load(mod).run({"x": rng.standard_normal(shape).astype(np.float32)}, return_intermediates=True)
    # the never-a-crash fuzz corpus (tests/npu/fuzz_corpus.py), every case through the ASan build
    import fuzz_corpus
    per_kind = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    fuzz_corpus.child_main(per_kind, 0, limit_memory=False, reference=False)
    print("asan: all kernels ran clean")


if __name__ == "__main__":
    main()
