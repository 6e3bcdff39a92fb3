"""Run-time kernel dispatch (dal/npu/dispatch.py, csrc/isa.h): every variant this CPU runs is
forced in turn and must equal the portable C++ kernels bit for bit on every named tensor, on
shapes with edge tiles (pixels not a multiple of the 6-row tile, channels not a multiple of
the 16-channel panel, odd panel counts for the two-panel zmm kernel and the 2 x 2 AMX tile
step, pixel counts around the 32-pixel AMX block, reductions not a multiple of 64 bytes) and
odd channel counts; results do not depend on the thread count; a batch in one call equals its
images one by one; AMX that the OS does not grant falls back to avx512_vnni, and says why."""
from __future__ import annotations

import os

import numpy as np
import pytest

import graphs
from dal.npu.dispatch import NAMES

SHAPES = [  # cin, cout, hw, k, stride, dilation, pads, act, wtype
    (3, 64, 23, 7, (2, 2), (1, 1), (3, 3, 3, 3), "u8", "s8"),     # explicit patch matrix
    (16, 16, 7, 3, (1, 1), (1, 1), (1, 1, 1, 1), "s8", "s8"),     # one panel, 49 pixels
    (17, 33, 11, 3, (1, 2), (2, 1), (2, 0, 1, 2), "u8", "s8"),    # odd everything, 3 panels
    (64, 48, 5, 1, (1, 1), (1, 1), (0, 0, 0, 0), "s8", "s4"),     # 1x1, int4 weights
    (32, 80, 9, 3, (2, 2), (1, 1), (1, 1, 1, 1), "u8", "u8"),     # 9-bit weight offsets: int16 panels
    (24, 1, 6, 3, (1, 1), (1, 1), (1, 1, 1, 1), "s8", "s8"),      # one output channel
    (36, 80, 19, 3, (1, 1), (1, 1), (1, 1, 1, 1), "u8", "s8"),    # 361 pixels, 5 panels, K = 324
    (96, 40, 6, 3, (1, 1), (1, 1), (0, 0, 0, 0), "s8", "s8"),     # 16 pixels: one AMX row tile, K = 864
]


def _named(sess, feed):
    outs, values = sess.run(feed, return_intermediates=True)
    return outs, values


def _assert_same(a, b, what):
    (oa, va), (ob, vb) = a, b
    assert set(va) == set(vb), what
    for k in vb:
        assert va[k].dtype == vb[k].dtype and va[k].shape == vb[k].shape, (what, k)
        assert np.array_equal(va[k], vb[k], equal_nan=va[k].dtype.kind == "f"), (what, k)
    for x, y in zip(oa, ob):
        assert np.array_equal(x, y), what


def _variants():
    import dal.npu as npu
    return npu.info()["supported"]


def test_info_names_the_choice(npu_lib):
    import dal.npu as npu
    info = npu.info()
    assert info["kernel"] == info["supported"][-1] and info["kernel"] in info["why"]
    assert "portable" in info["supported"]
    # the choice follows the CPU's own flags (read here from /proc/cpuinfo, not by dal)
    flags = set()
    try:
        line = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "flags:")
        flags = set(line.split(":", 1)[1].split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma"} <= flags
    expect = ("avx512_vnni" if avx512 else "avx_vnni" if {"avx_vnni", "avx2", "fma"} <= flags
              else "avx2" if {"avx2", "fma"} <= flags else "portable")
    if avx512 and {"amx_tile", "amx_int8"} <= flags and not os.environ.get("DAL_NPU_DISABLE_AMX"):
        # Linux lists amx_* only when it saves the tile state; the one check left is the
        # process's permission, asked here of the kernel directly (not through dal's probe)
        if _tile_permission():
            expect = "amx_int8"
    assert info["kernel"] == expect, (info, sorted(flags))
    assert set(info["status"]) == set(NAMES) and all(info["status"].values())
    if "amx_int8" not in info["supported"]:
        assert "amx_int8 unavailable: " + info["status"]["amx_int8"] in info["why"]
    print(f"kernel: {info['kernel']}; supported here: {info['supported']}; amx: {info['status']['amx_int8']}")


def _tile_permission() -> bool:
    """Whether Linux grants this process the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA), asked with ctypes: the test's own oracle for dal's probe."""
    import ctypes
    import platform
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86_64


def test_amx_off_falls_back_and_says_why(npu_lib):
    """With AMX unavailable (here: DAL_NPU_DISABLE_AMX=1 in a fresh process, the same path as a
    failed cpuid / XCR0 / permission check), the next best variant is chosen and info() names
    the failing check."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json, dal.npu as n; i = n.info(); "
            "print(json.dumps([i['kernel'], i['supported'], i['why'], i['status']['amx_int8']]))")
    env = dict(os.environ, DAL_NPU_DISABLE_AMX="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    kernel, sup, why, status = json.loads(r.stdout.strip().splitlines()[-1])
    assert "amx_int8" not in sup and kernel == sup[-1]
    assert kernel == [v for v in _variants() if v != "amx_int8"][-1]
    assert status == "disabled by DAL_NPU_DISABLE_AMX" and status in why


@pytest.mark.parametrize("i", range(len(SHAPES)))
def test_every_variant_equals_portable(i, npu_lib):
    import dal.npu as npu
    cin, cout, hw, k, s, d, p, act, wt = SHAPES[i]
    m = graphs.conv_model(seed=10 + i, act=act, wtype=wt, cin=cin, cout=cout, hw=hw, k=k, stride=s,
                          dilation=d, pads=p)
    feed = {"x": np.random.default_rng(i).standard_normal((1, cin, hw, hw)).astype(np.float32)}
    ref = _named(npu.load(m, kernel="portable", threads=1), feed)
    for v in _variants():
        sess = npu.load(m, kernel=v, threads=2)
        assert sess.kernel == v and any(getattr(st, "fast", False) for st in sess.steps)
        _assert_same(_named(sess, feed), ref, (v, SHAPES[i]))


@pytest.mark.parametrize("op,m,k,n", [("Gemm", 7, 33, 1000), ("MatMul", 13, 64, 17), ("Gemm", 1, 512, 40)])
def test_every_variant_equals_portable_gemm(op, m, k, n, npu_lib):
    import dal.npu as npu
    model = graphs.linear_model(seed=3, op=op, m=m, k=k, n=n, relu=True)
    feed = {"x": np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)}
    ref = _named(npu.load(model, kernel="portable", threads=1), feed)
    for v in _variants():
        _assert_same(_named(npu.load(model, kernel=v, threads=3), feed), ref, (v, op))


def test_thread_count_does_not_change_results(npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=4, cin=48, cout=96, hw=9, k=3)
    feed = {"x": np.random.default_rng(2).standard_normal((1, 48, 9, 9)).astype(np.float32)}
    ref = _named(npu.load(m, threads=1), feed)
    for t in (2, 3, 5):
        _assert_same(_named(npu.load(m, threads=t), feed), ref, t)


def test_batch_in_one_call_equals_images_one_by_one(npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=5, cin=20, cout=40, hw=10, k=3)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    x = np.random.default_rng(3).standard_normal((4, 20, 10, 10)).astype(np.float32)
    sess = npu.load(m, threads=2)
    whole = sess.run({"x": x}, return_intermediates=True)[1]
    for b in range(4):
        one = sess.run({"x": x[b:b + 1]}, return_intermediates=True)[1]
        batched = [k for k in one if one[k].shape[:1] == (1,) and whole[k].shape[:1] == (4,)]
        assert len(batched) >= 3
        for k in batched:
            assert np.array_equal(whole[k][b:b + 1], one[k], equal_nan=True), (b, k)


def test_unknown_or_unsupported_kernel_refused(npu_lib):
    import dal.npu as npu
    with pytest.raises(npu.NPUError, match="kernel must be one of"):
        npu.load(graphs.conv_model(seed=0), kernel="sse9")
    missing = [v for v in NAMES[1:] if v not in _variants()]
    for v in missing:
        with pytest.raises(npu.NPUError, match="cannot run"):
            npu.load(graphs.conv_model(seed=0), kernel=v)


def test_cpp_entry_point_refuses_an_absent_variant(npu_lib):
    """The C++ checks the variant itself: no illegal instruction even if Python were bypassed."""
    import torch
    with pytest.raises(RuntimeError, match="does not exist"):
        b = torch.zeros((1, 2, 16, 2), dtype=torch.int16)
        npu_lib.qgemm(torch.zeros((1, 4), dtype=torch.uint8), 0, b, torch.empty(0, dtype=torch.int32), 1,
                      torch.ones(16, dtype=torch.float64), *[torch.empty(0, dtype=t) for t in
                      (torch.int32, torch.float32, torch.int64, torch.int64)], 0, 1.0, 0, 0, 255, 1,
                      torch.empty(0, dtype=torch.int32), 1, 7)


def test_only_dispatched_functions_use_avx(npu_lib):
    """The library is built for the x86-64 baseline: VEX/EVEX instructions (AVX, AVX2, AVX-512,
    VNNI) and AMX tile instructions appear only in the target-attributed kernel variants that
    run after a cpuid check,
    so loading and using the build on an older CPU cannot hit an illegal instruction."""
    import re
    import shutil
    import subprocess
    if shutil.which("objdump") is None:
        pytest.skip("objdump not installed")
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", npu_lib.__file__],
                          capture_output=True, text=True, check=True).stdout
    fn, users = None, set()
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            fn = m.group(1)
        elif fn and re.search(r"\t(v[a-z0-9]+|kmov[a-z]*|tdp[a-z0-9]+|tile[a-z0-9]+|ldtilecfg|sttilecfg)(\s|$)", line):
            users.add(fn)
    allowed = re.compile(r"micro::|amx::|micro_avx2|micro_4x3|sparse_row_avx2|rq::bias_add_avx2|rq::float_codes_avx2"
                         r"|rq::float_codes_avx512|rq::requant_block_avx512|quant_avx2")
    assert users, "no AVX kernel found at all: the variants were not compiled in"
    assert not [u for u in users if not allowed.search(u)], sorted(u for u in users if not allowed.search(u))
