"""An FP16 RMSNorm island (``Fp16RMSNorm`` on the a2000) computed identically by dal.convert and
dal.npu, both equal to export/SPEC.md §5a's rule for its exported nodes:

    Pow(x, 2) -> ReduceMean -> Add(eps) -> Sqrt -> Div(1, .) -> Mul(x, .) -> Mul(weight)

each node rounded once to float32 (the mean: its float64 sum divided by C, rounded once; the
Sqrt correctly rounded), between the float16 Casts of the island's input and output.

Before, dal.convert ran torch's fused float32 ``F.rms_norm`` (float32 sum of squares, one
``rsqrt``): an ulp of float32 off the chain on ~17% of elements, which at a float16 rounding
boundary moved the island's float16 output by an ulp and then an int8 code of the next
quantizer (the tiny Qwen2 INT8 decode of export/decoder_generate_check.py, prompt 9, step 46:
one ``lm_head.input_quant`` code, -78 against dal.npu's -77).

The inputs are adversarial: rows of float16 values whose float16 output, by SPEC's chain, differs
from the output of a chain that rounds differently (``1 / sqrt`` rounded once, a float32
running sum of squares, or the weight folded into one rounding) -- a float16 rounding boundary
lies between them -- chosen from seeded random rows by a numpy model of those chains. The oracle
is Python fractions for the mean of squares (exact), ``decimal`` at 60 digits for the square
root, correctly rounded to float32, and numpy's IEEE float32 Add, Div and Mul.
"""
from __future__ import annotations

from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import torch
from torch import nn

import dal
from convert_common import assert_bit_exact, build
from oracles import nearest_float

torch.set_num_threads(1)

C, EPS = 64, 1e-6


class NormLinear(nn.Module):
    """RMSNorm (read by an int8 Linear): a decoder's final norm before ``lm_head``, small."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.RMSNorm(C, eps=EPS), nn.Linear(C, 16)
        with torch.no_grad():  # a non-trivial weight, so that the weight Mul rounds
            self.norm.weight.copy_(torch.rand(C, generator=torch.Generator().manual_seed(1)) * 1.5 + 0.5)

    def forward(self, x):
        return self.fc(self.norm(x))


def _candidate_rows(n: int, seed: int) -> np.ndarray:
    """``[n, C]`` float16-valued float32 rows, row scales 2^-4 .. 2^4, magnitudes within 2^10 of
    each other in a row (so a row's float64 sum of squares is exact in any order)."""
    rng = np.random.default_rng(seed)
    mag = rng.uniform(2.0 ** -10, 1.0, (n, C)) * np.exp2(rng.uniform(-4, 4, (n, 1)))
    return (np.where(rng.random((n, C)) < 0.5, -mag, mag)).astype(np.float16).astype(np.float32)


def _chain(x: np.ndarray, w: np.ndarray, how: str) -> np.ndarray:
    """The island's float16 output in numpy: ``spec`` (SPEC's nodes) or a differently rounded chain."""
    f32 = np.float32
    if how == "running_sum":  # a float32 sum of squares, left to right
        ms = np.cumsum(x * x, axis=-1, dtype=f32)[:, -1:] / f32(C)
    else:
        ms = ((x.astype(np.float64) ** 2).sum(-1, keepdims=True) / C).astype(f32)
    v = ms + f32(EPS)
    r = (1.0 / np.sqrt(v.astype(np.float64))).astype(f32) if how == "rsqrt" else f32(1) / np.sqrt(v)
    if how == "fused_weight":
        y = (x.astype(np.float64) * r * w).astype(f32)
    else:
        y = (x * r) * w
    return y.astype(np.float16)


def _adversarial_rows(w: np.ndarray, count: int) -> np.ndarray:
    x = _candidate_rows(8192, seed=7)
    spec = _chain(x, w, "spec")
    differs = np.zeros(len(x), bool)
    for how in ("rsqrt", "running_sum", "fused_weight"):
        differs |= (_chain(x, w, how) != spec).any(-1)
    picked = x[differs][:count]
    assert len(picked) == count, f"only {len(picked)} adversarial rows among {len(x)}"
    return picked


def spec_island(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The float32 value the island's output Cast reads, by SPEC's rule (module doc), per row."""
    out = np.empty(x.shape, np.float32)
    e = Fraction(float(np.float32(eps)))
    with localcontext() as ctx:
        ctx.prec = 60
        for i, row in enumerate(x):
            sq = [Fraction(float(t)) ** 2 for t in row]  # Pow: exact squares of float16 values
            assert sum(float(s) for s in sq) == float(sum(sq)), "row's float64 sum is not exact"
            ms = nearest_float(sum(sq) / len(sq), np.float32)
            v = np.float32(ms) + np.float32(float(e))  # Add: numpy's IEEE float32
            vf = Fraction(float(v))
            s = nearest_float(Fraction((Decimal(vf.numerator) / Decimal(vf.denominator)).sqrt()), np.float32)
            r = np.float32(1) / np.float32(s)  # Div
            out[i] = (row * r) * w  # the two Muls, float32
    return out


def _island_output(proto) -> str:
    cast = next(n for n in proto.graph.node if n.op_type == "Cast" and n.name.startswith("/norm/output_quant/"))
    return cast.input[0]


def test_fp16_rmsnorm_island_follows_spec_in_both_engines():
    torch.manual_seed(0)
    x0 = torch.randn(4, 8, C)
    qat, proto, sess = build(NormLinear(), x0, "a2000")
    assert type(qat.norm).__name__ == "Fp16RMSNorm", type(qat.norm)
    ops = [n.op_type for n in proto.graph.node if n.name.startswith("/norm/")]
    assert ops.count("Sqrt") == 1 and ops.count("ReduceMean") == 1 and ops.count("Div") == 1, ops
    w = qat.norm.weight.detach().numpy().astype(np.float16).astype(np.float32)
    rows = _adversarial_rows(w, 32)
    batch = torch.from_numpy(rows).reshape(4, 8, C)

    im = dal.convert(qat)
    seen = {}
    island = getattr(im.net.norm, "qat", im.net.norm)  # the QAT module inside its form
    island.output_quant.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("out", args[0].numpy().copy()))
    im(batch)
    _, values = sess.run({sess.input_names[0]: batch.numpy()}, return_intermediates=True)

    want = spec_island(rows, w, EPS).reshape(batch.shape)
    got, npu = seen["out"], np.asarray(values[_island_output(proto)])
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), \
        f"dal.convert is off SPEC's RMSNorm chain on {(got != want).sum()} of {got.size} float32 values"
    assert np.array_equal(npu.view(np.int32), want.view(np.int32)), \
        f"dal.npu is off SPEC's RMSNorm chain on {(npu != want).sum()} of {npu.size} float32 values"
    # end to end: every int8 code of the Linear and every output element
    assert_bit_exact(im, proto, sess, [batch, torch.from_numpy(_candidate_rows(32, seed=3)).reshape(4, 8, C)],
                     "fp16 rmsnorm -> int8 linear")
