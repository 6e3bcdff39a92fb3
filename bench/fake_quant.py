"""Fake quantization forward + backward on a 64x64x56x56 float32 tensor, one thread.

Every variant runs ``y = f(x); y.backward(ones)`` with ``x.requires_grad`` and is reported as a
multiple of the memory-bound floor ``f(x) = x * c`` measured in the same run. Repetitions are
interleaved (variant A, B, C, A, B, C, ...) and the median is reported: this machine is shared
and absolute times swing 1.5-2x between runs, ratios much less.

Peers: torch.fake_quantize_per_tensor_affine / per_channel_affine (they multiply by 1/scale,
so they are not ONNX-exact) and a torch FP8 cast round trip. dal is timed twice: the default
``fake_quantize`` (fused C++ kernel when available) and the eager autograd function.

    python bench/fake_quant.py [repetitions]        # default 15

Targets: dal <= 2.0x the floor for INT8 / INT4, <= 2.5x for FP8.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from dal.formats import FP8_E4M3, INT4, INT8, PER_TENSOR, fake_quantize, native, per_channel
from dal.formats.autograd import FakeQuantizeFunction

SHAPE = (64, 64, 56, 56)
TARGETS = {"int8": 2.0, "int4": 2.0, "fp8_e4m3": 2.5}


def variants(x: torch.Tensor) -> dict:
    C = x.shape[1]
    amax = float(x.detach().abs().max())
    v = {"floor x*c": lambda t: t * 1.0001}
    for fmt in (INT8, INT4, FP8_E4M3):
        s_t = torch.tensor(amax / fmt.qmax)
        s_c = torch.full((C,), amax / fmt.qmax)
        zp_t, zp_c = torch.zeros(()), torch.zeros(C)
        lo, hi = int(fmt.qmin), int(fmt.qmax)
        if fmt.is_integer:
            v[f"torch per_tensor {fmt.name}"] = lambda t, s=float(s_t), lo=lo, hi=hi: \
                torch.fake_quantize_per_tensor_affine(t, s, 0, lo, hi)
            v[f"torch per_channel {fmt.name}"] = lambda t, s=s_c, z=zp_c.int(), lo=lo, hi=hi: \
                torch.fake_quantize_per_channel_affine(t, s, z, 1, lo, hi)
        else:
            v["torch fp8 cast round trip (per tensor)"] = lambda t, s=s_t: \
                (t / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s
        for gname, gran, s, z in (("per_tensor", PER_TENSOR, s_t, zp_t), ("per_channel", per_channel(1), s_c, zp_c)):
            v[f"dal {gname} {fmt.name}"] = lambda t, f=fmt, g=gran, s=s, z=z: \
                fake_quantize(t, f, s, z, g, check=False)
            v[f"dal eager {gname} {fmt.name}"] = lambda t, f=fmt, g=gran, s=s, z=z: \
                FakeQuantizeFunction.apply(t, s, z, f, g, f.qmin, f.qmax, 1.0)
    return v


def main(reps: int = 15) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(SHAPE).requires_grad_()
    ones = torch.ones(SHAPE)
    fns = variants(x)
    times = {k: [] for k in fns}
    for rep in range(reps + 1):  # the first round warms up (kernel build, allocator) and is dropped
        for name, fn in fns.items():
            x.grad = None
            t0 = time.perf_counter()
            fn(x).backward(ones)
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["floor x*c"]
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
    print(f"fake_quantize fwd+bwd, {'x'.join(map(str, SHAPE))} float32, 1 thread, {reps} interleaved reps, medians")
    print(f"THP_MEM_ALLOC_ENABLE={thp!r} ({'set' if thp == '1' else 'NOT set'}: torch's allocator "
          f"{'uses' if thp == '1' else 'does not use'} transparent huge pages)")
    print(f"fused kernel: {native.status()}")
    print(f"{'variant':44s} {'ms':>8s} {'x floor':>8s}")
    ratios = {}
    for name, t in med.items():
        ratios[name] = t / floor
        mark = ""
        if name.startswith("dal ") and not name.startswith("dal eager"):
            target = TARGETS[name.split()[-1]]
            mark = f"  target <= {target}: {'ok' if ratios[name] <= target else 'MISSED'}"
        print(f"{name:44s} {t * 1e3:8.2f} {ratios[name]:8.2f}{mark}")
    return ratios


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
