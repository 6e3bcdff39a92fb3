// Requantizers: int32 accumulators -> integer codes. See gemm_s16.h for the exact formulas.
#include <algorithm>
#include <cmath>
#ifdef DAL_NPU_AVX2
#include <immintrin.h>
#endif

#include "gemm_s16.h"

namespace dal_npu {

namespace {
void check_rows(const char* who, const torch::Tensor& acc, const torch::Tensor& t, torch::ScalarType st) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == st && t.is_contiguous() && t.size(0) == acc.size(0),
              who, ": per-row parameter has wrong dtype/shape");
}
}  // namespace

torch::Tensor requant_float(const torch::Tensor& acc, const torch::Tensor& mult,
                            const torch::Tensor& bias, const torch::Tensor& y_scale,
                            const torch::Tensor& zp, int64_t qmin, int64_t qmax, int64_t nthreads) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == torch::kInt32 && acc.is_contiguous(),
              "requant_float: acc must be contiguous int32 [C, P]");
  check_rows("requant_float", acc, mult, torch::kFloat64);
  check_rows("requant_float", acc, y_scale, torch::kFloat32);
  check_rows("requant_float", acc, zp, torch::kInt32);
  const bool has_bias = bias.numel() > 0;
  if (has_bias) check_rows("requant_float", acc, bias, torch::kFloat32);
  TORCH_CHECK(qmin <= qmax && qmin >= -(int64_t(1) << 31) && qmax < (int64_t(1) << 31), "requant_float: bad range");
  nthreads = std::max<int64_t>(1, nthreads);
  const int64_t C = acc.size(0), P = acc.size(1);
  auto out = torch::empty({C, P}, torch::dtype(torch::kInt32));
  const int32_t* a = acc.data_ptr<int32_t>();
  int32_t* o = out.data_ptr<int32_t>();
  const double* mu = mult.data_ptr<double>();
  const float* ys = y_scale.data_ptr<float>();
  const int32_t* z = zp.data_ptr<int32_t>();
  const float* bs = has_bias ? bias.data_ptr<float>() : nullptr;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t c = 0; c < C; ++c) {
    const double m = mu[c];
    const float s = ys[c], b = has_bias ? bs[c] : 0.0f;
    // clamp before the int conversion, in the code-minus-zero-point domain (exact small ints)
    const float lo = float(qmin - z[c]), hi = float(qmax - z[c]);
    const int32_t* ar = a + c * P;
    int32_t* orow = o + c * P;
    int64_t p = 0;
#ifdef DAL_NPU_AVX2
    const __m256d vm = _mm256_set1_pd(m);
    const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    const __m256i vz = _mm256_set1_epi32(z[c]);
    for (; p + 8 <= P; p += 8) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar + p));
      const __m128 f0 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(x)), vm));
      const __m128 f1 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(x, 1)), vm));
      __m256 v = _mm256_set_m128(f1, f0);
      if (has_bias) v = _mm256_add_ps(v, vb);
      v = _mm256_round_ps(_mm256_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_min_ps(_mm256_max_ps(v, vlo), vhi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + p), _mm256_add_epi32(_mm256_cvtps_epi32(v), vz));
    }
#endif
    for (; p < P; ++p) {
      float v = static_cast<float>(static_cast<double>(ar[p]) * m);
      if (has_bias) v = v + b;
      float r = std::nearbyint(v / s);  // default rounding mode: half to even
      r = std::min(std::max(r, lo), hi);
      orow[p] = static_cast<int32_t>(r) + z[c];
    }
  }
  return out;
}

torch::Tensor requant_fixed(const torch::Tensor& acc, const torch::Tensor& m, const torch::Tensor& n,
                            const torch::Tensor& zp, int64_t qmin, int64_t qmax, int64_t rounding,
                            int64_t nthreads) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == torch::kInt32 && acc.is_contiguous(),
              "requant_fixed: acc must be contiguous int32 [C, P]");
  check_rows("requant_fixed", acc, m, torch::kInt64);
  check_rows("requant_fixed", acc, n, torch::kInt64);
  check_rows("requant_fixed", acc, zp, torch::kInt32);
  TORCH_CHECK(rounding >= 0 && rounding <= 2, "requant_fixed: rounding must be 0, 1 or 2");
  TORCH_CHECK(qmin <= qmax, "requant_fixed: bad range");
  nthreads = std::max<int64_t>(1, nthreads);
  const int64_t C = acc.size(0), P = acc.size(1);
  const int64_t* mp = m.data_ptr<int64_t>();
  const int64_t* np_ = n.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(mp[c] >= 0 && mp[c] < (int64_t(1) << 62), "requant_fixed: multiplier out of range at row ", c);
    TORCH_CHECK(np_[c] >= -62 && np_[c] <= 100, "requant_fixed: shift out of range at row ", c);
  }
  auto out = torch::empty({C, P}, torch::dtype(torch::kInt32));
  const int32_t* a = acc.data_ptr<int32_t>();
  int32_t* o = out.data_ptr<int32_t>();
  const int32_t* z = zp.data_ptr<int32_t>();
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t c = 0; c < C; ++c) {
    const __int128 mul = mp[c];
    const int64_t sh = np_[c];
    for (int64_t p = 0; p < P; ++p) {
      const __int128 prod = static_cast<__int128>(a[c * P + p]) * mul;
      __int128 r;
      if (sh <= 0) {
        r = prod * (static_cast<__int128>(1) << (-sh));
      } else {
        const __int128 h = static_cast<__int128>(1) << (sh - 1);
        const __int128 f = prod >> sh;  // arithmetic shift: floor division by 2^sh
        const __int128 rem = prod - f * (static_cast<__int128>(1) << sh);
        if (rounding == 0) {
          r = rem >= h ? f + 1 : f;                      // ties toward +inf
        } else if (rounding == 1) {
          r = rem > h ? f + 1 : rem < h ? f : f + (f & 1);  // ties to even
        } else {
          r = rem > h ? f + 1 : rem < h ? f : (prod >= 0 ? f + 1 : f);  // ties away from zero
        }
      }
      r += z[c];
      if (r < qmin) r = qmin;
      if (r > qmax) r = qmax;
      o[c * P + p] = static_cast<int32_t>(r);
    }
  }
  return out;
}

}  // namespace dal_npu
