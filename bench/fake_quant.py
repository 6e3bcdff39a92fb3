"""Fake quantization forward + backward on a 64x64x56x56 float32 tensor, one thread.

Every variant runs ``y = f(x); y.backward(ones)`` with ``x.requires_grad`` and is reported as a
multiple of the memory-bound floor ``f(x) = x * c`` measured in the same run. Repetitions are
interleaved (variant A, B, C, A, B, C, ...) and the median is reported, in CPU time of the one
thread (``time.thread_time``): this machine is shared, the wall clock also counts the waits
for a core, and absolute times swing 1.5-2x between runs, ratios much less.

Peers: torch.fake_quantize_per_tensor_affine / per_channel_affine (they multiply by 1/scale,
so they are not ONNX-exact) and a torch FP8 cast round trip. dal is timed twice: the default
``fake_quantize`` (fused C++ kernel when available) and the eager autograd function. Then a QAT
quantizer's whole step (observer, scale, fake quantization: dal.formats.track) and the BN-folded
weight of QConvBn2d training (dal.formats.fold), each against the torch path it replaces.

    python bench/fake_quant.py [repetitions] [--only SUBSTRING]   # default 15

``--only`` keeps the variants whose name contains SUBSTRING (and the floor), e.g. ``--only lsq``.

Then dal.kernels' registered ops (``op ...``) eagerly and under ``torch.compile`` (``op compiled
...``, inductor), each forward + backward, with the floor compiled too (``op compiled floor x*c``).

Targets: dal <= 2.0x the floor for INT8 / INT4, <= 2.5x for FP8; every registered op <= 2.0x,
eager and compiled.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from cpu import cpu_flags  # bench/cpu.py
from dal.formats import FP8_E4M3, INT4, INT8, PER_TENSOR, fake_quantize, native, per_channel
from dal.formats.autograd import FakeQuantizeFunction

SHAPE = (64, 64, 56, 56)
TARGETS = {"int8": 2.0, "int4": 2.0, "fp8_e4m3": 2.5}
OP_TARGET = 2.0  # issue 40: every registered op at most 2x the floor, eager and compiled


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
    s_l = torch.full((C,), amax / 7).requires_grad_()  # the eager LSQ route FakeQuantizer took before dal::fake_quantize_lsq
    v["dal eager lsq per_channel int4 (+ d/ds), FakeQuantizeFunction"] = lambda t: \
        FakeQuantizeFunction.apply(t, s_l, torch.zeros(C), INT4, per_channel(1), INT4.qmin, INT4.qmax, 1e-3)
    return v


def qat_variants(x: torch.Tensor) -> dict:
    """A QAT quantizer's whole step (observer update, scale, fake quantization) and the BN-folded
    weight ``fq(W * f) / f`` of QConvBn2d training, each by dal's C++ path and by the torch path
    it replaces (the same bits). Empty where this dal has no such path (an older checkout)."""
    try:
        from dal.formats.fold import FoldedFakeQuantizeFunction
        from dal.quantizer import FakeQuantizer
    except ImportError:
        return {}
    v = {}
    for path in ("C++", "torch"):
        q = FakeQuantizer("uint8", symmetric=False, observer="moving_average").train()
        q(x.detach())
        q.end_observation("quantize")
        if path == "torch" and hasattr(q, "use_kernel"):
            q.use_kernel(False)  # the public switch (this tree)
        elif path == "torch":  # an older checkout: make its C++ path decline
            q._kernel_forward = lambda t: None
            q._kernel_params = lambda t, f: None
        v[f"dal QAT quantizer uint8 per_tensor, {path} path"] = q
    rows = x.shape[0]
    f = (torch.rand(rows) + 0.5).requires_grad_()
    s = x.detach().reshape(rows, -1).abs().amax(dim=1) * 2 / 127
    zp = torch.zeros(rows, dtype=torch.int32)
    f4 = f.reshape(-1, *[1] * (x.dim() - 1))
    v["dal BN-fold fq(W*f)/f int8 per_channel, C++"] = lambda t: \
        FoldedFakeQuantizeFunction.apply(t, f, s, zp, INT8, -128, 127, True)
    v["dal BN-fold fq(W*f)/f int8 per_channel, op by op"] = lambda t: \
        fake_quantize(t * f4, INT8, s, zp, per_channel(0), check=False) / f4
    return v


def op_variants(x: torch.Tensor) -> dict:
    """dal.kernels' registered ops called directly, eagerly (the op's CPU implementation: the C++
    kernel where it applies) and under ``torch.compile`` (inductor; the op stays opaque in the
    graph), with the ``x*c`` floor compiled the same way. Empty where this dal has no dal.kernels."""
    try:
        from dal import kernels
        from dal.quantizer import FakeQuantizer
        from dal.quantizer_ops import ops_forward
    except ImportError:
        return {}
    C = x.shape[1]
    amax = float(x.detach().abs().max())
    fns = {"floor x*c": lambda t: t * 1.0001}
    for fmt in (INT8, INT4, FP8_E4M3):
        for gname, gran, shape in (("per_tensor", PER_TENSOR, ()), ("per_channel", per_channel(1), (C,))):
            s = torch.full(shape, amax / fmt.qmax)
            z = torch.zeros(shape, dtype=torch.int32)
            fns[f"fake_quantize {gname} {fmt.name}"] = lambda t, f=fmt, g=gran, s=s, z=z: \
                kernels.fake_quantize(t, s, z, f, g)
    s_l = torch.full((C,), amax / 7).requires_grad_()
    fns["fake_quantize_lsq per_channel int4 (+ d/ds)"] = lambda t: \
        kernels.fake_quantize_lsq(t, s_l, None, INT4, per_channel(1), grad_scale=1e-3)
    s_t = torch.tensor(amax / 127).requires_grad_()
    z_t = torch.tensor(0.3).requires_grad_()
    fns["fake_quantize_lsq per_tensor uint8 (+ d/ds, d/dzp: LSQ+)"] = lambda t: \
        kernels.fake_quantize_lsq(t, s_t, z_t, "uint8", PER_TENSOR, grad_scale=1e-3)
    s_f = torch.full((C,), amax / 448).requires_grad_()
    fns["fake_quantize_lsq per_channel fp8_e4m3 (+ d/ds)"] = lambda t: \
        kernels.fake_quantize_lsq(t, s_f, None, FP8_E4M3, per_channel(1), grad_scale=1e-3)
    fns["fp_round_trip fp16"] = lambda t: kernels.fp_round_trip(t, torch.float16)
    fns["fp_round_trip bf16"] = lambda t: kernels.fp_round_trip(t, torch.bfloat16)
    q = FakeQuantizer("uint8", symmetric=False, observer="moving_average").train()
    q(x.detach())
    q.end_observation("quantize")
    fns["QAT quantizer uint8 (observe_minmax_, minmax_qparams, fake_quantize)"] = \
        lambda t, q=q: ops_forward(q, t)
    v = {}
    for name, fn in fns.items():
        v[f"op {name}"] = fn
        v[f"op compiled {name}"] = torch.compile(fn)
    return v


def main(reps: int = 15, only: str | None = None) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(SHAPE).requires_grad_()
    ones = torch.ones(SHAPE)
    fns = {**variants(x), **qat_variants(x), **op_variants(x)}
    if only:
        fns = {k: f for k, f in fns.items() if only in k or "floor" in k}
    times = {k: [] for k in fns}
    for rep in range(reps + 1):  # the first round warms up (kernel build, allocator) and is dropped
        for name, fn in fns.items():
            x.grad = None
            t0 = time.thread_time()
            fn(x).backward(ones)
            dt = time.thread_time() - t0
            if rep:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["floor x*c"]
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
    print(f"fake_quantize fwd+bwd, {'x'.join(map(str, SHAPE))} float32, 1 thread, {reps} interleaved reps, "
          "medians of CPU time")
    print(f"THP_MEM_ALLOC_ENABLE={thp!r} ({'set' if thp == '1' else 'NOT set'}: torch's allocator "
          f"{'uses' if thp == '1' else 'does not use'} transparent huge pages)")
    print(f"fused kernel: {native.status()}; CPU: {cpu_flags()}; load average {os.getloadavg()}")
    print(f"{'variant':78s} {'ms':>8s} {'x floor':>8s}   (x floor: against the eager 'floor x*c')")
    ratios = {}
    for name, t in med.items():
        ratios[name] = t / floor
        mark = ""
        if name.startswith("dal ") and not name.startswith(("dal eager", "dal QAT", "dal BN")):
            target = TARGETS[name.split()[-1]]
            mark = f"  target <= {target}: {'ok' if ratios[name] <= target else 'MISSED'}"
        elif name.startswith("op ") and "floor" not in name:
            mark = f"  target <= {OP_TARGET}: {'ok' if ratios[name] <= OP_TARGET else 'MISSED'}"
        print(f"{name:78s} {t * 1e3:8.2f} {ratios[name]:8.2f}{mark}")
    if not only:
        per_call()
    return ratios


def per_call(reps: int = 400) -> None:
    """The per-call cost, where QAT's overhead is: the same variants on a small tensor
    (8x64x7x7, a late ResNet layer's activation), in microseconds per forward + backward."""
    x = torch.randn(8, 64, 7, 7).requires_grad_()
    ones = torch.ones_like(x)
    fns = {"floor x*c": lambda t: t * 1.0001, **qat_variants(x)}
    times = {k: [] for k in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            x.grad = None
            t0 = time.thread_time()
            fn(x).backward(ones)
            if rep:
                times[name].append(time.thread_time() - t0)
    print(f"per call, 8x64x7x7, {reps} interleaved reps, medians of CPU time")
    for name, v in times.items():
        print(f"{name:44s} {statistics.median(v) * 1e6:8.1f} us")


if __name__ == "__main__":
    args = sys.argv[1:]
    only = args[args.index("--only") + 1] if "--only" in args else None
    if "--only" in args:
        del args[args.index("--only"):args.index("--only") + 2]
    main(int(args[0]) if args else 15, only)
