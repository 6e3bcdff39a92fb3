// QuantizeLinear of a float32 tensor with one scale and one 8-bit zero point, in C++ (the
// graph input's quantizer: in numpy it was a third of a batch-1 ResNet-18 run).
//
//   q = clamp(round_half_even(x / s) + zp, qmin, qmax)      float32 division
//
// as quant.py computes it: the clamp runs on r = round(x / s) against [qmin - zp, qmax - zp]
// (exact integers in float32) and zp is added after, which equals numpy's float64
// clip(r + zp): for |r| < 2^53 that sum is exact, beyond it both clamp to the same bound.
// The AVX2 form does the same IEEE operations in the same order (vdivps, vroundps to nearest
// even), so both forms are bit-identical; in the flat (not pixel-major) layout it narrows the
// codes to bytes in registers (quant_avx2_bytes) instead of through an int32 buffer. NaN has no code: the call is refused (the caller
// then runs quant.py, which defines what NaN becomes).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "qconv.h"
#include "quantize.h"

namespace dal_npu {

// codes of x[0..n) into q[0..n) (quantize.h); true when some x / s is NaN
bool quant_scalar(const float* x, int64_t n, float s, float lo, float hi, int32_t zp, int32_t* q) {
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    float r = x[i] / s;
    if (std::isnan(r)) {
      nan = true;
      r = 0.0f;
    }
    r = std::nearbyint(r);
    r = std::min(std::max(r, lo), hi);
    q[i] = static_cast<int32_t>(r) + zp;
  }
  return nan;
}

namespace {

// the codes of x[0..8) as int32 lanes: quant_scalar's IEEE operations in its order (vdivps,
// vroundps to nearest even, max / min, + zp); NaN lanes of x / s are or-ed into bad
DAL_TARGET_AVX2 inline __m256i quant_avx2_lanes(const float* x, __m256 vs, __m256 vlo, __m256 vhi, __m256i vz, __m256& bad) {
  __m256 r = _mm256_div_ps(_mm256_loadu_ps(x), vs);
  bad = _mm256_or_ps(bad, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
  r = _mm256_round_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm256_min_ps(_mm256_max_ps(r, vlo), vhi);
  return _mm256_add_epi32(_mm256_cvtps_epi32(r), vz);
}

// quant_avx2's codes narrowed to bytes in registers and stored: each code is already in
// [qmin, qmax] (int8 or uint8), so the saturating packs (int32 -> int16 -> int8 / uint8) change
// none of them and the bytes are the codes' low bytes, as the scalar store writes them
template <bool U8>
DAL_TARGET_AVX2 bool quant_avx2_bytes(const float* x, int64_t n, float s, float lo, float hi, int32_t zp, uint8_t* o) {
  const __m256 vs = _mm256_set1_ps(s), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  const __m256i vz = _mm256_set1_epi32(zp);
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = quant_avx2_lanes(x + i, vs, vlo, vhi, vz, bad);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(o + i), U8 ? _mm_packus_epi16(w, w) : _mm_packs_epi16(w, w));
  }
  int32_t q[8];
  const bool tail = quant_scalar(x + i, n - i, s, lo, hi, zp, q);
  for (int64_t j = 0; j < n - i; ++j) o[i + j] = static_cast<uint8_t>(q[j]);
  return (_mm256_movemask_ps(bad) != 0) | tail;
}

}  // namespace

// quant_scalar's codes, eight lanes at a time (quantize.h)
DAL_TARGET_AVX2 bool quant_avx2(const float* x, int64_t n, float s, float lo, float hi, int32_t zp, int32_t* q) {
  const __m256 vs = _mm256_set1_ps(s), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  const __m256i vz = _mm256_set1_epi32(zp);
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), quant_avx2_lanes(x + i, vs, vlo, vhi, vz, bad));
  return (_mm256_movemask_ps(bad) != 0) | quant_scalar(x + i, n - i, s, lo, hi, zp, q + i);
}

torch::Tensor quantize_codes(const torch::Tensor& X, double scale, int64_t zp, int64_t out_code, bool nhwc,
                             int64_t nthreads, int64_t isa) {
  TORCH_CHECK(X.scalar_type() == torch::kFloat32 && X.is_contiguous(), "quantize_codes: X must be contiguous float32");
  TORCH_CHECK(!nhwc || X.dim() == 4, "quantize_codes: the pixel-major form needs X [N, C, H, W]");
  TORCH_CHECK(out_code == 1 || out_code == 2, "quantize_codes: out_code must be 1 (uint8) or 2 (int8)");
  const float s = static_cast<float>(scale);
  TORCH_CHECK(std::isfinite(s) && s > 0 && double(s) == scale, "quantize_codes: the scale must be a finite float32 > 0");
  const int32_t qmin = out_code == 1 ? 0 : -128, qmax = out_code == 1 ? 255 : 127;
  TORCH_CHECK(zp >= qmin && zp <= qmax, "quantize_codes: zero point outside the code range");
  const int v = isa_resolve(isa);
  nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024));
  const int32_t z = static_cast<int32_t>(zp);
  const float lo = float(qmin - z), hi = float(qmax - z);
  // tasks: an output image row (pixel-major: all C channels of one (n, y), so that each output
  // line is written by one thread -- a task per (n, c, y) had both threads write the same
  // interleaved lines, 1.48x on two threads), else pieces of 4096 of the flat tensor
  const int64_t numel = X.numel(), N = nhwc ? X.size(0) : 1, C = nhwc ? X.size(1) : 1;
  const int64_t W = nhwc ? X.size(3) : 4096, R = nhwc ? N * X.size(2) : (numel + W - 1) / W;
  auto out = nhwc ? torch::empty({N, X.size(2), W, C}, torch::dtype(out_code == 1 ? torch::kUInt8 : torch::kInt8))
                  : torch::empty(X.sizes(), torch::dtype(out_code == 1 ? torch::kUInt8 : torch::kInt8));
  const float* x = X.data_ptr<float>();
  uint8_t* o = reinterpret_cast<uint8_t*>(out.data_ptr());
  bool nan = false;
  const int64_t H = nhwc ? X.size(2) : 1;
#pragma omp parallel num_threads(nthreads) reduction(|| : nan)
  {
    std::vector<int32_t> q(static_cast<size_t>(W));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {  // r = n * H + y (pixel-major), else a piece
      for (int64_t c = 0; c < C; ++c) {
        const int64_t y = r % H, n = r / H;
        const float* xs = nhwc ? x + ((n * C + c) * H + y) * W : x + r * W;
        const int64_t len = nhwc ? W : std::min(W, numel - r * W);
        if (!nhwc && isa_has_avx2(v)) {  // the codes straight to their bytes
          const bool b = out_code == 1 ? quant_avx2_bytes<true>(xs, len, s, lo, hi, z, o + r * W)
                                       : quant_avx2_bytes<false>(xs, len, s, lo, hi, z, o + r * W);
          nan = nan || b;
          continue;
        }
        const bool b = isa_has_avx2(v) ? quant_avx2(xs, len, s, lo, hi, z, q.data())
                                       : quant_scalar(xs, len, s, lo, hi, z, q.data());
        nan = nan || b;
        if (!nhwc) {
          for (int64_t i = 0; i < len; ++i) o[r * W + i] = static_cast<uint8_t>(q[i]);
          continue;
        }
        uint8_t* d = o + r * W * C + c;
        for (int64_t i = 0; i < W; ++i) d[i * C] = static_cast<uint8_t>(q[i]);
      }
    }
  }
  TORCH_CHECK(!nan, "quantize_codes: x / scale is NaN");
  return out;
}

}  // namespace dal_npu
