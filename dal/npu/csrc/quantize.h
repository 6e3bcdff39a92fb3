// QuantizeLinear of float32 values with one scale and one zero point, the codes as int32
// (quantize.cpp; the blocked linear's requantizer calls them too, blocked_gemm.cpp):
//
//   q[i] = clamp(round_half_even(x[i] / s), lo, hi) + zp      float32 division, lo / hi = qmin / qmax - zp
//
// Both return true when some x / s is NaN (that value then has no code: the caller refuses the
// call); quant_avx2 does quant_scalar's IEEE operations in the same order, so both are bit-identical.
#pragma once

#include <cstdint>

#include "isa.h"

namespace dal_npu {

bool quant_scalar(const float* x, int64_t n, float s, float lo, float hi, int32_t zp, int32_t* q);
DAL_TARGET_AVX2 bool quant_avx2(const float* x, int64_t n, float s, float lo, float hi, int32_t zp, int32_t* q);

}  // namespace dal_npu
