// The blocked linear of export/SPEC.md §5a (dal/npu/blocked_groups.py) in one C++ call: 8-bit
// activation codes x weights blocked along the K input channels (blocks of B, the last one
// ragged when B does not divide K), one exact int32 accumulator per block, combined in float64:
//
//   acc_b[m, n] = sum_{k in block b} (x[m, k] - zx) * Wd[k, n]          exact int32
//   t[m, n]     = (((acc_0 s_0[n] + acc_1 s_1[n]) + acc_2 s_2[n]) + ...)  float64, b ascending,
//                 each product exact (|acc_b| < 2^29: checked by the matcher), no FMA
//   v[m, n]     = float32(sx * t[m, n])                                   float64 product, then float32
//   codes (per reader r): clamp(round_half_even(v / ys_r) + zy_r, lo_r, hi_r)   float32 division
//
// Weights (minus their zero point) are packed once at load, per block b and 16-column panel p:
//   int8  form [nb, NP, Bq, 16, 4] (Bq = ceil(B / 4); values in [-128, 127]) with wsum[nb, NP*16]
//         int32 = the block's column sums: vpdpbusd on u = code - base (base 0 for uint8 codes,
//         -128 for int8), acc_b = sum u w - (zx - base) wsum_b, exact modulo 2^32, hence exact;
//   int16 form [nb, NP, Bh, 16, 2] (Bh = ceil(B / 2)): vpmaddwd on int16 (code - zx) pairs.
// Rows of a block beyond B (the padding to a multiple of 4 or 2) and beyond K (the ragged last
// block) hold zero weights. ws: float64 [nb, NP*16] block scales (s_b[n] at [b, n]).
#pragma once
#include <torch/types.h>  // ATen and the torch:: names; pybind11 only in module.cpp

#include <vector>

namespace dal_npu {

// X: codes [M, K] (uint8 or int8, contiguous). isa: the kernel variant (isa.h), -1 = the best
// this CPU runs; the int8 form runs on portable / avx_vnni / avx512_vnni (amx_int8 uses the
// avx512_vnni kernel), the int16 form on portable / avx2 (and above). Returns {v} (float32
// [M, N]) when ys is empty, else one code tensor [M, N] per reader: ys float32 [R], zy / lo /
// hi / out_code int64 [R] (out_code 1 uint8, 2 int8); lo <= hi within the code type's range.
std::vector<torch::Tensor> blocked_gemm(const torch::Tensor& X, int64_t zx, const torch::Tensor& Wp,
                                        const torch::Tensor& wsum, const torch::Tensor& ws, int64_t B,
                                        int64_t N, double sx, const torch::Tensor& ys, const torch::Tensor& zy,
                                        const torch::Tensor& lo, const torch::Tensor& hi,
                                        const torch::Tensor& out_code, int64_t nthreads, int64_t isa);

}  // namespace dal_npu
