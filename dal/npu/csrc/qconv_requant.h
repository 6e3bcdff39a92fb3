// Requantizer of the fused groups (qconv.cpp): one pixel's int32 accumulators -> codes.
//   float:  q = clamp(round_half_even(float32(float64(acc) * mult[o]) (+ bias_f[o]) / ys) + zy, lo, hi)
//   fixed:  q = clamp(round_shift(acc * fp_m[o], fp_n[o]) + zy, lo, hi)
// The AVX2 form (8 channels at a time) performs the same IEEE operations in the same order as
// the scalar form (cvtpd_ps and round_ps round to nearest even, as the scalar casts and
// nearbyint do under the default rounding mode; -ffp-contract=off forbids fused multiply-adds),
// so the two are bit-identical; the AVX-512 form (16 channels) likewise, except that it clamps
// the quotient before the rounding conversion (the same codes: see requant_block_avx512).
// Included by qconv.cpp only.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "isa.h"

namespace dal_npu {
namespace rq {

struct Requant {
  int64_t O = 0, Op = 0;             // channels written / channels in the accumulator row
  const double* mult = nullptr;      // [Op]
  const int32_t* bias_q = nullptr;   // [Op] or null
  const float* bias_f = nullptr;     // [Op] or null
  const int64_t* fp_m = nullptr;     // [Op] fixed point, or null for float
  const int64_t* fp_n = nullptr;
  const int32_t* corr = nullptr;     // [Op] subtracted first (VNNI zero-point offset), or null
  int rounding = 0;
  float ys = 1.0f;
  int32_t zy = 0, lo = 0, hi = 0;

  // the same requantizer restricted to channels [c0, c1) (c1 <= Op)
  Requant slice(int64_t c0, int64_t c1) const {
    Requant r = *this;
    r.O = std::max<int64_t>(0, std::min(O, c1) - c0);
    r.Op = c1 - c0;
    r.mult = mult + c0;
    if (bias_q) r.bias_q = bias_q + c0;
    if (bias_f) r.bias_f = bias_f + c0;
    if (fp_m) r.fp_m = fp_m + c0, r.fp_n = fp_n + c0;
    if (corr) r.corr = corr + c0;
    return r;
  }
};

// round_shift(acc * m, sh) of metadata.py, saturated to +-2^40 (the caller clamps further)
inline int64_t round_shift_fixed(int32_t acc, int64_t m, int64_t sh, int rounding) {
  const __int128 prod = static_cast<__int128>(acc) * m;
  const __int128 big = static_cast<__int128>(1) << 40;
  if (sh <= 0) {
    const __int128 r = prod * (static_cast<__int128>(1) << (-sh));
    return static_cast<int64_t>(r > big ? big : r < -big ? -big : r);
  }
  const __int128 h = static_cast<__int128>(1) << (sh - 1);
  const __int128 f = prod >> sh;
  const __int128 rem = prod - f * (static_cast<__int128>(1) << sh);
  __int128 r;
  if (rounding == 0) r = rem >= h ? f + 1 : f;
  else if (rounding == 1) r = rem > h ? f + 1 : rem < h ? f : f + (f & 1);
  else r = rem > h ? f + 1 : rem < h ? f : (prod >= 0 ? f + 1 : f);
  return static_cast<int64_t>(r > big ? big : r < -big ? -big : r);
}

// acc[0..n) += b (n a multiple of 8); true when a sum left int32
DAL_TARGET_AVX2 inline bool bias_add_avx2(int32_t* acc, const int32_t* b, int64_t n) {
  __m256i bad = _mm256_setzero_si256();
  for (int64_t o = 0; o + 8 <= n; o += 8) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + o));
    const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + o));
    const __m256i s = _mm256_add_epi32(a, bb);
    bad = _mm256_or_si256(bad, _mm256_and_si256(_mm256_xor_si256(a, s), _mm256_xor_si256(bb, s)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + o), s);
  }
  return _mm256_movemask_ps(_mm256_castsi256_ps(bad)) != 0;
}

// codes[0..n8) of the float requantizer, n8 = O rounded down to 8
DAL_TARGET_AVX2 inline void float_codes_avx2(const Requant& q, const int32_t* acc, int32_t* codes, int64_t n8) {
  const __m256 vys = _mm256_set1_ps(q.ys), vlo = _mm256_set1_ps(float(q.lo - q.zy)),
               vhi = _mm256_set1_ps(float(q.hi - q.zy));
  const __m256i vz = _mm256_set1_epi32(q.zy);
  for (int64_t o = 0; o < n8; o += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + o));
    const __m128 f0 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(x)),
                                                    _mm256_loadu_pd(q.mult + o)));
    const __m128 f1 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(x, 1)),
                                                    _mm256_loadu_pd(q.mult + o + 4)));
    __m256 v = _mm256_set_m128(f1, f0);
    if (q.bias_f) v = _mm256_add_ps(v, _mm256_loadu_ps(q.bias_f + o));
    v = _mm256_round_ps(_mm256_div_ps(v, vys), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, vlo), vhi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + o), _mm256_add_epi32(_mm256_cvtps_epi32(v), vz));
  }
}

// The float requantizer of 16 int32 sums x of channels c..c+15, requant_row's formula per
// element: v = float32(float64(x) * mult[c]) (+ bias_f[c]), rint(v / ys) half to even, clamped
// to [lo - zy, hi - zy], + zy (mult = q.mult, bias_f = q.bias_f, passed apart so that a caller's
// loop can hold them in registers). Shared by the row and the block forms below. The quotient is
// clamped, then rounded half to even by the conversion itself (vcvtps2dq with embedded rounding,
// whatever MXCSR holds): the same codes as rounding first, since the bounds are integers and
// rint is monotone, and a NaN still becomes lo - zy (vmaxps returns its second operand).
DAL_TARGET_AVX512VNNI inline __m512i float_codes16_avx512(const double* mult, const float* bias_f, __m512i x,
                                                          int64_t c, __m512 vys, __m512 vlo, __m512 vhi,
                                                          __m512i vz) {
  const __m256 f0 = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(x)),
                                                  _mm512_loadu_pd(mult + c)));
  const __m256 f1 = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(x, 1)),
                                                  _mm512_loadu_pd(mult + c + 8)));
  __m512 v = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(f0)),
                                                 _mm256_castps_pd(f1), 1));
  if (bias_f) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_f + c));
  v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v, vys), vlo), vhi);
  return _mm512_add_epi32(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
}

// The same on zmm, 16 channels a step (avx512_vnni variant), the codes stored straight into
// out when it is contiguous (ostride 1; vpmovdb / vpmovdw truncation is exact: the codes are
// already clamped to the output type's range). Returns the channels done (a multiple of 16).
template <typename T>
DAL_TARGET_AVX512VNNI inline int64_t float_codes_avx512(const Requant& q, const int32_t* acc, T* out,
                                                        int64_t ostride) {
  const __m512 vys = _mm512_set1_ps(q.ys), vlo = _mm512_set1_ps(float(q.lo - q.zy)),
               vhi = _mm512_set1_ps(float(q.hi - q.zy));
  const __m512i vz = _mm512_set1_epi32(q.zy);
  int64_t o = 0;
  for (; o + 16 <= q.O; o += 16) {
    const __m512i c =
        float_codes16_avx512(q.mult, q.bias_f, _mm512_loadu_si512(acc + o), o, vys, vlo, vhi, vz);
    if (ostride == 1 && sizeof(T) == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + o), _mm512_cvtepi32_epi8(c));
    } else if (ostride == 1 && sizeof(T) == 4) {
      _mm512_storeu_si512(out + o, c);
    } else {
      alignas(64) int32_t codes[16];
      _mm512_store_si512(codes, c);
      for (int k = 0; k < 16; ++k) out[(o + k) * ostride] = static_cast<T>(codes[k]);
    }
  }
  return o;
}

// A whole block at once (avx512_vnni or amx_int8, float requantizer, 8-bit codes, pixel-major output, no
// acc_out, every channel of the slice real and a multiple of 16): per 16 channels the VNNI
// offset subtraction, the bias add with its overflow test, the requantizer and the store, all
// in registers -- the same operations as requant_row's passes, in the same order per element.
// acc: pn rows of q.Op int32; row lp's codes go to out + lp * ldo. True on bias overflow.
template <typename T>
inline bool block_ok(const Requant& q, int isa) {
  return sizeof(T) == 1 && isa_has_avx512(isa) && !q.fp_m && q.O == q.Op && q.O % 16 == 0;
}

template <typename T>
DAL_TARGET_AVX512VNNI inline bool requant_block_avx512(const Requant& q, const int32_t* acc, int64_t pn, T* out,
                                                       int64_t ldo) {
  // q's fields in locals: the 8-bit stores may alias anything, so reading them through q
  // reloaded and retested every field per vector (scalar uops on the vector ports: measured
  // ~17 -> ~14.5 cycles per 16 codes together with the rounding change of float_codes16_avx512)
  const int32_t* __restrict corr = q.corr;
  const int32_t* __restrict bias_q = q.bias_q;
  const float* __restrict bias_f = q.bias_f;
  const double* __restrict mult = q.mult;
  const int64_t O = q.O, Op = q.Op;
  const __m512 vys = _mm512_set1_ps(q.ys), vlo = _mm512_set1_ps(float(q.lo - q.zy)),
               vhi = _mm512_set1_ps(float(q.hi - q.zy));
  const __m512i vz = _mm512_set1_epi32(q.zy), zero = _mm512_setzero_si512();
  __m512i bad = zero;
  for (int64_t lp = 0; lp < pn; ++lp) {
    const int32_t* a = acc + lp * Op;
    T* o = out + lp * ldo;
    for (int64_t c = 0; c < O; c += 16) {
      __m512i x = _mm512_loadu_si512(a + c);
      if (corr) x = _mm512_sub_epi32(x, _mm512_loadu_si512(corr + c));  // wraps, as uint32
      if (bias_q) {
        const __m512i b = _mm512_loadu_si512(bias_q + c), sum = _mm512_add_epi32(x, b);
        bad = _mm512_or_si512(bad, _mm512_and_si512(_mm512_xor_si512(x, sum), _mm512_xor_si512(b, sum)));
        x = sum;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + c),
                       _mm512_cvtepi32_epi8(float_codes16_avx512(mult, bias_f, x, c, vys, vlo, vhi, vz)));
    }
  }
  return _mm512_cmplt_epi32_mask(bad, zero) != 0;  // a sign bit set: some sum left int32
}

// acc row (Op int32, one pixel) -> codes[0..O) of that pixel at stride ostride; the final
// accumulators (+ bias_q) to acc_out when given. Returns true on bias overflow.
template <typename T>
bool requant_row(const Requant& q, int32_t* acc, T* out, int64_t ostride, int32_t* acc_out,
                 int64_t astride, int isa) {
  bool ovf = false;
  const bool avx2 = isa_has_avx2(isa);
  if (q.corr)  // exact modulo 2^32, and the true sum fits int32: wrapping subtraction is exact
    for (int64_t c = 0; c < q.Op; ++c)
      acc[c] = static_cast<int32_t>(static_cast<uint32_t>(acc[c]) - static_cast<uint32_t>(q.corr[c]));
  if (q.bias_q) {
    int64_t o = 0;
    if (avx2) {
      o = q.Op / 8 * 8;
      ovf = bias_add_avx2(acc, q.bias_q, o);
    }
    for (; o < q.Op; ++o) {
      const int64_t s = int64_t(acc[o]) + q.bias_q[o];
      if (s < INT32_MIN || s > INT32_MAX) ovf = true;
      acc[o] = static_cast<int32_t>(s);
    }
  }
  if (acc_out)
    for (int64_t c = 0; c < q.O; ++c) acc_out[c * astride] = acc[c];
  if (q.fp_m) {
    for (int64_t c = 0; c < q.O; ++c) {
      int64_t r = round_shift_fixed(acc[c], q.fp_m[c], q.fp_n[c], q.rounding) + q.zy;
      r = std::min<int64_t>(std::max<int64_t>(r, q.lo), q.hi);
      out[c * ostride] = static_cast<T>(r);
    }
    return ovf;
  }
  int64_t o = 0;
  if (isa_has_avx512(isa)) o = float_codes_avx512<T>(q, acc, out, ostride);
  if (avx2 && o + 8 <= q.O) {
    alignas(32) int32_t codes[64];
    for (; o + 8 <= q.O; o += 64) {
      const int64_t n8 = std::min<int64_t>(64, q.O - o) / 8 * 8;
      Requant part = q.slice(o, q.Op);
      float_codes_avx2(part, acc + o, codes, n8);
      for (int64_t k = 0; k < n8; ++k) out[(o + k) * ostride] = static_cast<T>(codes[k]);
      if (n8 < 64) {
        o += n8;
        break;
      }
    }
  }
  const float lo = float(q.lo - q.zy), hi = float(q.hi - q.zy);
  for (; o < q.O; ++o) {
    float v = static_cast<float>(static_cast<double>(acc[o]) * q.mult[o]);
    if (q.bias_f) v = v + q.bias_f[o];
    float r = std::nearbyint(v / q.ys);
    r = std::min(std::max(r, lo), hi);
    out[o * ostride] = static_cast<T>(static_cast<int32_t>(r) + q.zy);
  }
  return ovf;
}

}  // namespace rq
}  // namespace dal_npu
