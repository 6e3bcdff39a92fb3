"""dal.npu runs every (op class, formats) pair each bundled hardware model claims.

For every YAML in hardware_models/, every op class it lists and every combination of its
claimed input, output (and weight) formats, one single-op graph (claims_graphs.py) runs in
dal.npu (semantics "integer", what the NPU computes) and in an oracle: onnxruntime with
optimizations off, or, when a role is fp16, onnx.reference on the graph's float64 twin (see
_twin64 for why onnxruntime is no float16 oracle). Integer outputs: codes agree within 1 LSB;
fp8 outputs: within one step of the float8 grid; fp16 outputs: within one float16 ulp.
Variants: pool = MaxPool, AveragePool, GlobalAveragePool; activation = Relu, Sigmoid and every
lut_ops / fp16_ops entry with a single ONNX op (silu and rsqrt export as two ops: not here);
resize = each resize_modes entry (nearest: asymmetric/floor and half_pixel; linear/bilinear in
four coordinate modes; bicubic). A pair dal.npu cannot run yet would be an xfail(strict=True)
naming what is missing (KNOWN_GAPS; none left).

Measured 2026-12-02: 1104 parametrizations, 779 distinct graphs (a graph shared by several
hardware models runs once), 147221 output elements; 7 elements differ, each by 1 LSB (int4
ConvTranspose, fp16 HardSigmoid); generic_int8's bicubic Resize: 9 graphs, 2160 codes, 0 differ.
"""
from __future__ import annotations

import functools
import itertools
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import claims_graphs as cg
import oracles

ROOT = Path(__file__).resolve().parents[2]
HARDWARE = sorted(p.stem for p in (ROOT / "hardware_models").glob("*.yaml"))
LINEAR_CTMS = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")
# what dal.npu cannot run yet: predicate on (op class, variant, in, out, weight) -> what is missing
KNOWN_GAPS: dict = {}  # none since ops_dense runs cubic Resize (generic_int8's bicubic)


def _variants(hw, cls):
    if cls == "pool":
        return list(cg.POOL_ATTRS)
    if cls == "activation":
        names = set(hw.lut_ops) | {n for n in hw.fp16_ops if n in cg.ACTIVATION_OPS}
        ops = {cg.ACTIVATION_OPS[n] for n in names if n in cg.ACTIVATION_OPS}
        return ["Relu", "Sigmoid"] + sorted(ops - {"Sigmoid"})
    if cls == "resize":
        out = []
        for mode in hw.resize_modes:
            if mode == "nearest":
                out += ["nearest:asymmetric", "nearest:half_pixel"]
            elif mode in ("linear", "bilinear"):
                out += [f"linear:{c}" for c in LINEAR_CTMS if f"linear:{c}" not in out]
            elif mode == "bicubic":
                out += ["cubic:half_pixel"]
        return out
    return [""]


def _cases():
    import dal
    for name in HARDWARE:
        hw = dal.load_hardware(name)
        for sup in hw.ops:
            cls = sup.op_class
            ins = [f.name for f in sup.input_formats] or [None]
            outs = [f.name for f in sup.output_formats]
            ws = [f.name for f in sup.weight_formats] or [None]
            for var, fi, fo, fw in itertools.product(_variants(hw, cls), ins, outs, ws):
                pow2 = hw.requantizer.kind == "power_of_two"
                yield name, cls, var, fi, fo, fw, pow2


def _gap(cls, var, fi, fo, fw):
    """Why dal.npu cannot run this pair yet, or None."""
    for test, reason in KNOWN_GAPS.items():
        if test(cls, var, fi, fo, fw):
            return reason
    return None


def _params():
    out = []
    for name, cls, var, fi, fo, fw, pow2 in _cases():
        label = "-".join(str(p) for p in (name, cls, var or None, f"in={fi}", f"out={fo}", f"w={fw}")
                         if p is not None and not str(p).endswith("=None"))
        reason = _gap(cls, var, fi, fo, fw)
        marks = [pytest.mark.xfail(strict=True, reason=f"dal.npu cannot run {label} yet: {reason}")] if reason else []
        out.append(pytest.param(cls, var, fi, fo, fw, pow2, id=label, marks=marks))
    return out


def _fp_steps(a, b, fmt):
    """Distance of two float arrays on the ``fmt`` grid (float8 / float16 ordinals)."""
    dt = {"fp16": (np.float16, np.int16), "fp8_e4m3": (ml_dtypes.float8_e4m3fn, np.int8),
          "fp8_e5m2": (ml_dtypes.float8_e5m2, np.int8)}[fmt]

    def key(v):
        c = np.asarray(v, np.float32).astype(dt[0])
        assert np.array_equal(c.astype(np.float32), np.asarray(v, np.float32)), f"not on the {fmt} grid"
        i = c.view(dt[1]).astype(np.int64)
        return np.where(i < 0, -(i & (np.iinfo(dt[1]).max)), i)
    return np.abs(key(a) - key(b))


def _ort(m, feeds):
    return oracles.run_ort(m, feeds)[0]


def _reference(m, feeds):
    return oracles.run_reference(oracles.raise_opset(m), feeds)[0]


def _twin64(build):
    """onnx.reference on the float64 twin of a float16 graph (claims_graphs.build twin64): each
    float16 op computed in float64 and rounded once to float16. Neither runtime is an oracle
    for float16 arithmetic itself: onnxruntime's CPU float16 kernels are not correctly rounded
    (tests/npu/test_float_islands.py: up to 3 ulps elementwise, 0.64% for Conv/MatMul/Gemm),
    and where it has none it runs float32 between Casts it inserts and drops the Cast pair at
    the output (measured here: "float16" outputs off the float16 grid); onnx.reference's
    float16 ConvTranspose accumulates in float16 (thousands of ulps near cancellation)."""
    def run(m, feeds):
        return oracles.run_reference(oracles.raise_opset(build(twin64=True)[0]), feeds)[0]
    return run


@functools.lru_cache(maxsize=None)
def _outcome(cls, var, fi, fo, fw, pow2):
    """(max difference, count differing, count) of dal.npu against onnxruntime on this case."""
    import dal.npu as npu
    twin = "fp16" in (fi, fo, fw)
    m0, feeds, _ = cg.build(cls, var, fi, fo, fw, pow2)
    amax = float(np.abs(_twin64(functools.partial(cg.build, cls, var, fi, fo, fw, pow2))(m0, feeds)
                        if twin else _ort(m0, feeds)).max())
    m, feeds, _ = cg.build(cls, var, fi, fo, fw, pow2, amax=amax)
    want = (_twin64(functools.partial(cg.build, cls, var, fi, fo, fw, pow2, amax=amax))(m, feeds)
            if twin else _ort(m, feeds))
    if want.dtype == np.float64:
        want = want.astype(np.float32)
    got = npu.load(m).run(feeds)[0]
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if fo in cg.INT_RANGE:
        d = np.abs(got.astype(np.int64) - want.astype(np.int64))
    else:
        d = _fp_steps(got, want, fo)
    return int(d.max(initial=0)), int((d > 0).sum()), int(d.size)


@pytest.mark.parametrize("cls,var,fi,fo,fw,pow2", _params())
def test_claimed_pair_runs(cls, var, fi, fo, fw, pow2, npu_lib):
    worst, n_diff, n = _outcome(cls, var, fi, fo, fw, pow2)
    assert worst <= 1, f"{n_diff} of {n} output codes differ from onnxruntime, up to {worst} LSB"
