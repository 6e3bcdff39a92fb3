// Fused integer groups: int codes in -> int codes out, one C++ call per Conv/Gemm group.
//
//   acc[o, p] = sum_k (x[k, p] - zx) * Wd[o, k]          exact int32 (vpmaddwd on int16 pairs)
//             (+ bias_q[o], int32; overflow raises)
//   float:  q = clamp(round_half_even(float32(float64(acc) * mult[o]) (+ bias_f[o]) / ys) + zy, lo, hi)
//   fixed:  q = clamp(round_shift(acc * fp_m[o], fp_n[o]) + zy, lo, hi)   (rounding 0/1/2)
//
// Bp: weights minus their zero point, packed at load as [ceil(O/16), K/2, 16, 2] int16 with
// k = (i * kw + j) * Cp + c (implicit: Cp = C rounded up to even) or k = (i * kw + j) * C + c
// (explicit patch matrix; K rounded up to even); for qgemm k is the column of X.
// Per-channel vectors (mult float64, bias_q int32, bias_f float32, fp_m / fp_n int64) have
// round_up(O, 16) entries; empty tensors mean "absent". out_code: 0 int32, 1 uint8, 2 int8.
// acc_out (int32, optional): receives acc (+ bias_q) in the output's layout.
// int8 panels [ceil(O/16), K/4, 16, 4] (weights minus zero point within [-128, 127], 8-bit
// input codes; chosen at load when the kernel variant has VNNI): vpdpbusd on u = code - base (base 0 for uint8, -128 for int8)
// with the image padded by uz = zx - base, and acc -= uz * wsum[o] (wsum[o] = sum_k Wd[o, k],
// int32 [round_up(O, 16)]); exact modulo 2^32, hence exact whenever the true sum fits int32.
#pragma once
#include <torch/types.h>  // ATen and the torch:: names; pybind11 only in module.cpp

#include "isa.h"

namespace dal_npu {

// isa (last argument): the kernel variant of isa.h, -1 = the best this CPU runs; a variant
// the CPU lacks is refused. int8 panels run on any variant (portable code below avx_vnni).
// X: codes [C, H, W] (uint8 / int8 / int16) -> codes [O, OH*OW]; or a batch [N, C, H, W] ->
// [N, O, OH*OW] in one call (acc_out then holds N*O*P values in the same layout).
// layout bit 0: X is pixel-major [N, H, W, C] (channels contiguous: the image copy is a row
// copy, and uint8 codes whose windows stay inside the image are read in place); bit 1: the
// output and acc_out are pixel-major [N, OH*OW, O] (each pixel's codes contiguous).
torch::Tensor qconv(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
                    int64_t O,
                    int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                    int64_t pt, int64_t pl, int64_t OH, int64_t OW, bool implicit,
                    const torch::Tensor& mult, const torch::Tensor& bias_q, const torch::Tensor& bias_f,
                    const torch::Tensor& fp_m, const torch::Tensor& fp_n, int64_t rounding, double ys,
                    int64_t zy, int64_t lo, int64_t hi, int64_t out_code, const torch::Tensor& acc_out,
                    int64_t nthreads, int64_t isa, int64_t layout);

// X: codes [M, K] -> codes [M, O]
torch::Tensor qgemm(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
                    int64_t O,
                    const torch::Tensor& mult, const torch::Tensor& bias_q, const torch::Tensor& bias_f,
                    const torch::Tensor& fp_m, const torch::Tensor& fp_n, int64_t rounding, double ys,
                    int64_t zy, int64_t lo, int64_t hi, int64_t out_code, const torch::Tensor& acc_out,
                    int64_t nthreads, int64_t isa);

// MaxPool of codes [C, H, W] over valid (unpadded) positions, then out = lut[max - lut_base].
torch::Tensor maxpool_codes(const torch::Tensor& X, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                            int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW,
                            const torch::Tensor& lut, int64_t lut_base, int64_t nthreads);

// The same on pixel-major codes [N, H, W, C] -> [N, OH, OW, C].
torch::Tensor maxpool_codes_nhwc(const torch::Tensor& X, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                 int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW,
                                 const torch::Tensor& lut, int64_t lut_base, int64_t nthreads);

// QuantizeLinear of float32 X (one scale, one zero point) to uint8 (out_code 1) / int8 (2)
// codes (csrc/quantize.cpp); nhwc: X [N, C, H, W] -> codes [N, H, W, C]. Refuses NaN.
torch::Tensor quantize_codes(const torch::Tensor& X, double scale, int64_t zp, int64_t out_code, bool nhwc,
                             int64_t nthreads, int64_t isa);

// out[i] = lut[(a[i] - base_a) * na + (b[i] - base_b)] for two code tensors of one shape.
torch::Tensor lut2_codes(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& lut,
                         int64_t base_a, int64_t base_b, int64_t nb, int64_t nthreads);

// Per (image, channel) float32(float64 sum of table[code byte] over the pixels / float64(H*W))
// (float64 division, one rounding; table float32 [256]) of 8-bit codes [N, C, H, W] (nhwc 0) or pixel-major
// [N, H, W, C] (nhwc 1) -> float32 [N, C, 1, 1]. Each sum is added in pixel order by one
// thread (gap_codes.py: exact, hence the same in any order).
torch::Tensor gap_codes_mean(const torch::Tensor& X, const torch::Tensor& table, int64_t nhwc,
                             int64_t nthreads);

}  // namespace dal_npu
