// Exact integer GEMM kernels of the dal NPU reference.
//
// Operands are int16 values with the zero point already subtracted (so an int8/uint8/int4
// code minus its zero point lies in [-255, 255]); products are at most 255*255 = 65025 and a
// pair sum at most 130050, so the AVX2 form below (vpmaddwd: int16 x int16 -> pairwise int32
// sums) can never saturate. vpmaddubsw (u8 x s8 -> saturating int16 pair sums) is deliberately
// NOT used: that is exactly what makes onnxruntime's MLAS kernels inexact on CPUs without VNNI.
// Accumulation is int32; callers check K * 255 * 255 < 2^31 (or accept wrap like ConvInteger).
#pragma once
#include <torch/types.h>  // ATen and the torch:: names; pybind11 only in module.cpp

namespace dal_npu {

// C[M, N] (int32) = A[M, K] (int16, row-major, K even, zero padded) x B where B is "pair packed":
// Bp[K/2, Np, 2] int16 with Bp[k2, n, j] = B[2*k2 + j, n]; Np is a multiple of 16 >= N.
torch::Tensor gemm_s16(const torch::Tensor& A, const torch::Tensor& Bp, int64_t N, int64_t nthreads);

// Same product with A given as 2:4 sparse along K: vals[M, K/4, 2] int16 (the two kept values
// of each group of 4, in position order) and pos[M, K/4] uint8 (p0 | p1 << 2, p0 < p1);
// B plain row-major [K, Np] int16.
torch::Tensor sparse24_gemm_s16(const torch::Tensor& vals, const torch::Tensor& pos,
                                const torch::Tensor& B, int64_t N, int64_t nthreads);

// im2col of one image X[C, H, W] (int16, zero point already subtracted, so padding is 0).
// Row k = (c * kh + i) * kw + j, column p = oy * OW + ox. paired: Bp layout [K2, Np, 2] for
// gemm_s16 (K2 = ceil(K/2)); else plain [K, Np] for sparse24_gemm_s16. Np = round_up(P, 16).
torch::Tensor im2col_s16(const torch::Tensor& X, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                         int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW,
                         bool paired, int64_t nthreads);

// Depthwise conv (one output channel per input channel) of X[C, H, W] with Wt[C, kh*kw]
// (both int16, zero points subtracted) -> int32 [C, OH, OW].
torch::Tensor dwconv_s16(const torch::Tensor& X, const torch::Tensor& Wt, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl,
                         int64_t OH, int64_t OW, int64_t nthreads);

// Float requantizer (ONNX QuantizeLinear semantics on the kernel's float value), row c of acc:
//   v = float(double(acc) * mult[c]) (+ bias[c] as a float32 add when bias is non-empty)
//   q = clamp(round_half_even(v / y_scale[c]) + zp[c], qmin, qmax)   (float32 division)
// Returns int32; mult is float64 (s_x * s_w[c], exact in float64).
torch::Tensor requant_float(const torch::Tensor& acc, const torch::Tensor& mult,
                            const torch::Tensor& bias, const torch::Tensor& y_scale,
                            const torch::Tensor& zp, int64_t qmin, int64_t qmax, int64_t nthreads);

// Fixed-point requantizer: q = clamp(round_shift(acc * m[c], n[c]) + zp[c], qmin, qmax) with
// rounding 0 = half_up (ties to +inf), 1 = half_even, 2 = half_away (from zero); a negative n
// is a left shift. Products are computed in 128-bit integers, so nothing can overflow.
torch::Tensor requant_fixed(const torch::Tensor& acc, const torch::Tensor& m, const torch::Tensor& n,
                            const torch::Tensor& zp, int64_t qmin, int64_t qmax, int64_t rounding,
                            int64_t nthreads);

}  // namespace dal_npu
