"""How the fused kernels cut their work between threads (csrc/qconv.cpp make_plan, one OpenMP
region per call): pixel blocks in a multiple of the thread count, or, for maps with too few
pixel tiles, channel ranges reading one shared copy of the rows (amx_int8). Whatever the cut,
each output is one exact int32 sum, so every variant and every thread count must return
numpy's int64 accumulators and the same codes -- with and without acc_out (the one-pass block
requantizer runs only without it)."""
from __future__ import annotations

import numpy as np
import pytest

# cin, cout, hw, k, stride, pad: maps of 1..3 pixel tiles (channel split with 2-4 threads),
# a map whose tile count is odd (7x7 = 2 AMX tiles, 14x14 = 7), reductions with a 64-byte tail
CONVS = [
    (64, 512, 7, 3, 1, 1),    # 49 pixels, 32 panels: channels split at 3 and 4 threads
    (40, 96, 5, 3, 1, 1),     # 25 pixels (one AMX tile), K = 360: tail quads, 6 panels
    (128, 256, 14, 3, 2, 1),  # stride 2: 49 pixels from a 14x14 map
    (32, 48, 14, 3, 1, 1),    # 196 pixels: 7 AMX tiles over 2..4 threads, 3 panels (odd)
    (64, 64, 4, 1, 1, 0),     # 16 pixels 1x1 unpadded: uint8 rows read in place
    # the amx_int8 K blocks (csrc/qconv_amx.h: at most 9 steps of 64 bytes, tiles stored and
    # reloaded between blocks; test_amx_blocking.py has the GEMM edges)
    (80, 48, 9, 3, 1, 1),     # K 720: nk 12 (a 16-byte tail), two blocks; 81 pixels = 2 groups + 17
    (160, 96, 5, 3, 1, 1),    # K 1440: nk 23, three blocks; 25 pixels (one short group)
    (256, 64, 4, 3, 1, 1),    # K 2304: nk 36, four blocks, no tail; 16 pixels
    (264, 512, 7, 3, 1, 1),   # K 2376 (an 8-byte tail), weights 1.2 MB > amx::kWeightsL2: the
                              # groups run inside each pair and K block (groups_inside)
]


def _exact_conv(x, zx, w, k, s, p):
    """int64 sum_{c,i,j} (x[y*s+i-p, x*s+j-p, c] - zx) * w[o, c, i, j], the border = zx (adds 0)."""
    hw, _, cin = x.shape
    xp = np.full((hw + 2 * p, hw + 2 * p, cin), zx, dtype=np.int64)
    xp[p:p + hw, p:p + hw] = x
    oh = (hw + 2 * p - k) // s + 1
    cols = np.stack([xp[i:i + s * oh:s, j:j + s * oh:s] for i in range(k) for j in range(k)], axis=2)
    cols = cols.reshape(oh * oh, k * k * cin) - zx  # [P, (i, j, c)]
    wm = np.transpose(w, (0, 2, 3, 1)).reshape(w.shape[0], -1)
    return cols @ wm.T, oh  # [P, O]


@pytest.mark.parametrize("i", range(len(CONVS)))
def test_qconv_any_partition_exact(i, npu_lib):
    import torch
    import dal.npu as npu
    from dal.npu import kernels
    from dal.npu.dispatch import NAMES, has_vnni
    cin, cout, hw, k, s, p = CONVS[i]
    rng = np.random.default_rng(40 + i)
    x = rng.integers(0, 256, (hw, hw, cin)).astype(np.uint8)
    zx = 0 if p == 0 else 7  # 0 with no padding: the rows are read in place
    w = rng.integers(-128, 128, (cout, cin, k, k))
    exact, oh = _exact_conv(x, zx, w, k, s, p)
    mult = kernels.pad_channels(np.full(cout, 3e-5), cout, np.float64)
    e32, ef, e64 = (torch.empty(0, dtype=t) for t in (torch.int32, torch.float32, torch.int64))
    want = np.clip(np.rint((exact * 3e-5).astype(np.float32) / np.float32(0.25)) + 9, 0, 255).astype(np.uint8)
    for kernel in npu.info()["supported"]:
        isa = NAMES.index(kernel)
        step = 4 if has_vnni(isa) else 2
        wm = kernels.conv_weight_matrix(w, True, step)
        bp, ws = kernels.pack_weights(wm, step == 4)
        for threads in (1, 2, 3, 4):
            for with_acc in (True, False):
                acc = torch.empty(oh * oh * cout if with_acc else 0, dtype=torch.int32)
                q = npu_lib.qconv(torch.from_numpy(x[None]), zx, bp, ws, cout, k, k, s, s, 1, 1, p, p, oh, oh,
                                  True, mult, e32, ef, e64, e64, 0, 0.25, 9, 0, 255, 1, acc, threads, isa,
                                  3).numpy().reshape(oh * oh, cout)
                what = (kernel, threads, with_acc, CONVS[i])
                if with_acc:
                    assert np.array_equal(acc.numpy().reshape(oh * oh, cout), exact), what
                assert np.array_equal(q, want), what
