"""Shared by the dal.convert tests: a prepared + calibrated model, its ONNX file run by dal.npu,
and the element-by-element comparison of the integer model against it (outputs and every
QuantizeLinear output the file holds)."""
from __future__ import annotations

import numpy as np
import onnx
import torch

import dal
import dal.npu
from dal.verification.integer_model import group_mismatches, npu_group_calls
from export_common import prepared, randomize_bn


def build(model, x, hardware, recipe="int8_balanced", seed=0):
    """(qat model, ONNX proto with a dynamic batch, dal.npu session)."""
    randomize_bn(model, seed)
    qat = prepared(model, x, recipe, hardware, batches=2)
    proto = dal.export_onnx(qat, (x,), dynamic_batch=True)
    return qat, proto, dal.npu.load(proto, threads=1)


def npu_fused_groups(sess) -> int:
    """How many integer groups (DQ -> Conv/Gemm/MatMul -> Q) the NPU reference formed."""
    return sum(1 for s in sess.steps if getattr(s, "kind", "") == "fused")


def _is_float8(v) -> bool:
    return "float8" in str(np.asarray(v).dtype)


#: the FP8 bit pattern of -0 (sign bit only): both engines' values are +-0 there
_FP8_MINUS_ZERO = 0x80


def _fp8_bits(bits: np.ndarray) -> np.ndarray:
    """FP8 bit patterns with -0 read as +0. The two engines agree on every FP8 value, but a Relu
    of -0 (an FP8 -0 decoded, added to -0) is -0 in torch and +0 in numpy's SIMD maximum
    (dal.npu): IEEE max leaves the sign of a zero open and no later op can tell them apart."""
    bits = bits.astype(np.int64)
    return np.where(bits == _FP8_MINUS_ZERO, 0, bits)


def compare(int_model, proto: onnx.ModelProto, sess, x: torch.Tensor) -> dict:
    """Integer model vs dal.npu on input ``x``: differing elements of the outputs and of every
    QuantizeLinear output of the file (each must be matched by a code tensor of the integer
    model: a name left unmatched fails)."""
    out, codes = int_model.run_with_codes(x, fp8_bits=True)
    outs, values = sess.run({sess.input_names[0]: x.numpy()}, return_intermediates=True)
    fp8 = {k for k, v in values.items() if _is_float8(v)}
    values = {k: _fp8_bits(np.asarray(v).view(np.uint8)) if k in fp8 else v for k, v in values.items()}
    outs_t = out if isinstance(out, (tuple, list)) else [out]
    out_diff = sum(int((o.numpy() != r).sum()) for o, r in zip(outs_t, outs))
    mine = {}
    for qname, calls in codes.items():
        for k, c in enumerate(calls):
            name = f"{qname}.quantized" + (f"_{k}" if k else "")
            mine[name] = _fp8_bits(c.numpy()) if name in fp8 else c.numpy().astype(np.int64)
    q_outs = [n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    unmatched = [n for n in q_outs if n not in mine]
    code_diff = sum(int((mine[n] != values[n].astype(np.int64)).sum()) for n in q_outs if n in mine)
    n_codes = sum(values[n].size for n in q_outs if n in mine)
    return {"out_diff": out_diff, "code_diff": code_diff, "codes": n_codes, "unmatched": unmatched,
            "out_elements": sum(r.size for r in outs)}


def assert_bit_exact(int_model, proto, sess, batches, label=""):
    """Every output and code equal on each batch, and the same layers run as integer groups."""
    for x in batches:
        r = compare(int_model, proto, sess, x)
        assert not r["unmatched"], f"{label}: Q outputs with no integer-model codes: {r['unmatched'][:5]}"
        assert r["out_diff"] == 0 and r["code_diff"] == 0, f"{label}: integer model vs NPU differ: {r}"
        assert r["codes"] > 0
    groups = group_mismatches(npu_group_calls(proto, sess.steps), int_model.group_calls())
    assert not groups, f"{label}: integer group on one side only: {groups}"


def random_batches(shape, n=3, seed=100, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale for _ in range(n)]
