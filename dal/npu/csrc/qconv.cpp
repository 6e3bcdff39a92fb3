// One call per integer group: codes in -> codes out (see qconv.h for the contract).
//
// Weights are packed once at load as panels of 16 output channels, [O/16][K2][16][2] int16
// (zero point already subtracted), so the micro kernel streams one contiguous block per panel.
// Activations are turned once per call into a zero-bordered HWC int16 image (code minus zero
// point; padding is exactly 0): a pixel's patch for tap (i, j) is then C contiguous values, so
// the GEMM reads the image in place ("implicit GEMM": no im2col buffer) for any stride and
// dilation. Inputs with few channels (the first conv) get an explicit [P][K] patch matrix
// instead (short inner loops would dominate). Products use vpmaddwd on int16 pairs: exact.
#include "qconv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef DAL_NPU_AVX2
#include <immintrin.h>
#endif

namespace dal_npu {

namespace {

constexpr int TR = 6;    // pixels per micro tile
constexpr int TC = 16;   // output channels per panel (2 vectors of 8 int32)

inline int32_t pair_at(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// C[r][0..15] = sum_t sum_c2 pair(rows[r] + toff[t] + 2*c2) . B[(t*C2 + c2)][0..15][0..1]
template <int R>
void micro(const int16_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C2,
           const int16_t* B, int32_t* C, int64_t ldc) {
#ifdef DAL_NPU_AVX2
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t t = 0; t < ntaps; ++t) {
    const int64_t o = toff[t];
    const int16_t* a0 = rp[0] + o;
    const int16_t* a1 = R > 1 ? rp[1] + o : a0;
    const int16_t* a2 = R > 2 ? rp[2] + o : a0;
    const int16_t* a3 = R > 3 ? rp[3] + o : a0;
    const int16_t* a4 = R > 4 ? rp[4] + o : a0;
    const int16_t* a5 = R > 5 ? rp[5] + o : a0;
    for (int64_t c2 = 0; c2 < C2; ++c2, B += 2 * TC) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + 16));
      __m256i a;
#define DAL_ROW(r)                                                        \
  if (R > r) {                                                            \
    a = _mm256_set1_epi32(pair_at(a##r + 2 * c2));                        \
    c##r##0 = _mm256_add_epi32(c##r##0, _mm256_madd_epi16(a, b0));        \
    c##r##1 = _mm256_add_epi32(c##r##1, _mm256_madd_epi16(a, b1));        \
  }
      DAL_ROW(0) DAL_ROW(1) DAL_ROW(2) DAL_ROW(3) DAL_ROW(4) DAL_ROW(5)
#undef DAL_ROW
    }
  }
#define DAL_ST(r)                                                                          \
  if (R > r) {                                                                             \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc), c##r##0);                 \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + 8), c##r##1);             \
  }
  DAL_ST(0) DAL_ST(1) DAL_ST(2) DAL_ST(3) DAL_ST(4) DAL_ST(5)
#undef DAL_ST
#else
  int32_t acc[TR][TC] = {};
  for (int64_t t = 0; t < ntaps; ++t) {
    for (int64_t c2 = 0; c2 < C2; ++c2, B += 2 * TC) {
      for (int r = 0; r < R; ++r) {
        const int16_t* a = rp[r] + toff[t] + 2 * c2;
        const int32_t x0 = a[0], x1 = a[1];
        for (int n = 0; n < TC; ++n) acc[r][n] += x0 * int32_t(B[2 * n]) + x1 * int32_t(B[2 * n + 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(C + r * ldc, acc[r], sizeof(int32_t) * TC);
#endif
}

// VNNI variant: rows are u8 (code minus base), B holds s8 quads [K/4][16][4]; vpdpbusd sums
// four u8 x s8 products into int32 exactly (no int16 intermediate, unlike vpmaddubsw).
template <int R>
void micro_u8(const uint8_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C4,
              const int8_t* B, int32_t* C, int64_t ldc) {
#ifdef DAL_NPU_VNNI
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t t = 0; t < ntaps; ++t) {
    const int64_t o = toff[t];
    const uint8_t* a0 = rp[0] + o;
    const uint8_t* a1 = R > 1 ? rp[1] + o : a0;
    const uint8_t* a2 = R > 2 ? rp[2] + o : a0;
    const uint8_t* a3 = R > 3 ? rp[3] + o : a0;
    const uint8_t* a4 = R > 4 ? rp[4] + o : a0;
    const uint8_t* a5 = R > 5 ? rp[5] + o : a0;
    for (int64_t c4 = 0; c4 < C4; ++c4, B += 4 * TC) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + 32));
      __m256i a;
#define DAL_ROW(r)                                                        \
  if (R > r) {                                                            \
    int32_t q;                                                            \
    std::memcpy(&q, a##r + 4 * c4, 4);                                    \
    a = _mm256_set1_epi32(q);                                             \
    c##r##0 = _mm256_dpbusd_avx_epi32(c##r##0, a, b0);                    \
    c##r##1 = _mm256_dpbusd_avx_epi32(c##r##1, a, b1);                    \
  }
      DAL_ROW(0) DAL_ROW(1) DAL_ROW(2) DAL_ROW(3) DAL_ROW(4) DAL_ROW(5)
#undef DAL_ROW
    }
  }
#define DAL_ST(r)                                                                          \
  if (R > r) {                                                                             \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc), c##r##0);                 \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + 8), c##r##1);             \
  }
  DAL_ST(0) DAL_ST(1) DAL_ST(2) DAL_ST(3) DAL_ST(4) DAL_ST(5)
#undef DAL_ST
#else
  int32_t acc[TR][TC] = {};
  for (int64_t t = 0; t < ntaps; ++t) {
    for (int64_t c4 = 0; c4 < C4; ++c4, B += 4 * TC) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* a = rp[r] + toff[t] + 4 * c4;
        for (int n = 0; n < TC; ++n)
          for (int j = 0; j < 4; ++j) acc[r][n] += int32_t(a[j]) * int32_t(B[4 * n + j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(C + r * ldc, acc[r], sizeof(int32_t) * TC);
#endif
}

template <typename E, typename WT>
using MicroT = void (*)(const E* const*, const int64_t*, int64_t, int64_t, const WT*, int32_t*, int64_t);
const MicroT<int16_t, int16_t> kMicro16[TR + 1] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>};
const MicroT<uint8_t, int8_t> kMicro8[TR + 1] = {nullptr, micro_u8<1>, micro_u8<2>, micro_u8<3>,
                                                 micro_u8<4>, micro_u8<5>, micro_u8<6>};
inline const MicroT<int16_t, int16_t>* micro_table(const int16_t*) { return kMicro16; }
inline const MicroT<uint8_t, int8_t>* micro_table(const int8_t*) { return kMicro8; }

struct Requant {
  int64_t O = 0, Op = 0;
  const double* mult = nullptr;   // [Op]
  const int32_t* bias_q = nullptr;  // [Op] or null
  const float* bias_f = nullptr;  // [Op] or null
  const int64_t* fp_m = nullptr;  // [Op] fixed point, or null for float
  const int64_t* fp_n = nullptr;
  const int32_t* corr = nullptr;  // [Op] subtracted first (VNNI zero-point offset), or null
  int rounding = 0;
  float ys = 1.0f;
  int32_t zy = 0, lo = 0, hi = 0;
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

// acc row (Op int32, one pixel) -> codes[0..O) of that pixel; returns true on bias overflow.
template <typename T>
bool requant_row(const Requant& q, int32_t* acc, T* out, int64_t ostride, int32_t* acc_out,
                 int64_t astride) {
  bool ovf = false;
  int64_t o = 0;
  if (q.corr)  // exact modulo 2^32, and the true sum fits int32: wrapping subtraction is exact
    for (int64_t c = 0; c < q.Op; ++c)
      acc[c] = static_cast<int32_t>(static_cast<uint32_t>(acc[c]) - static_cast<uint32_t>(q.corr[c]));
  if (q.bias_q) {
#ifdef DAL_NPU_AVX2
    __m256i bad = _mm256_setzero_si256();
    for (; o + 8 <= q.Op; o += 8) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + o));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.bias_q + o));
      const __m256i s = _mm256_add_epi32(a, b);
      bad = _mm256_or_si256(bad, _mm256_and_si256(_mm256_xor_si256(a, s), _mm256_xor_si256(b, s)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + o), s);
    }
    ovf = _mm256_movemask_ps(_mm256_castsi256_ps(bad)) != 0;
#endif
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
  o = 0;
#ifdef DAL_NPU_AVX2
  const __m256 vys = _mm256_set1_ps(q.ys), vlo = _mm256_set1_ps(float(q.lo - q.zy)),
               vhi = _mm256_set1_ps(float(q.hi - q.zy));
  const __m256i vz = _mm256_set1_epi32(q.zy);
  for (; o + 8 <= q.O; o += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + o));
    const __m128 f0 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(x)),
                                                    _mm256_loadu_pd(q.mult + o)));
    const __m128 f1 = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(x, 1)),
                                                    _mm256_loadu_pd(q.mult + o + 4)));
    __m256 v = _mm256_set_m128(f1, f0);
    if (q.bias_f) v = _mm256_add_ps(v, _mm256_loadu_ps(q.bias_f + o));
    v = _mm256_round_ps(_mm256_div_ps(v, vys), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, vlo), vhi);
    alignas(32) int32_t tmp[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), _mm256_add_epi32(_mm256_cvtps_epi32(v), vz));
    for (int k = 0; k < 8; ++k) out[(o + k) * ostride] = static_cast<T>(tmp[k]);
  }
#endif
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

// GEMM over pixel rows (row pointers + tap offsets) against packed panels, requantized per
// pixel block while the accumulators are still in cache.
// E: row element (int16 pairs / uint8 quads), WT: packed weight element; one k step covers
// KS = 4 / sizeof(E) reduction indices, a panel step is TC * KS weights.
template <typename T, typename E, typename WT>
bool run_core(const std::vector<const E*>& rows, const std::vector<int64_t>& toff, int64_t C2,
              const WT* Bp, const Requant& q, T* out, bool chan_major, int32_t* acc_out,
              int64_t nthreads) {
  constexpr int64_t KS = 4 / sizeof(E);
  const auto* kMicro = micro_table(Bp);
  const int64_t P = static_cast<int64_t>(rows.size());
  const int64_t ntaps = static_cast<int64_t>(toff.size()), K2 = ntaps * C2;
  const int64_t npanels = q.Op / TC;
  // ~192 pixels per block: the block's accumulators stay in L2, the weights are streamed
  // once per block (a single block for the small late layers).
  const int64_t ntiles = (P + TR - 1) / TR;
  const int64_t nblocks = std::max<int64_t>(1, (ntiles + 31) / 32);
  const int64_t tiles_per = (ntiles + nblocks - 1) / nblocks, PB = tiles_per * TR;
  bool ovf = false;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(|| : ovf)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t p0 = blk * PB, pn = std::min<int64_t>(PB, P - p0);
    if (pn <= 0) continue;
    std::vector<int32_t> acc(static_cast<size_t>(pn) * q.Op);
    for (int64_t pnl = 0; pnl < npanels; ++pnl) {
      const WT* B = Bp + pnl * K2 * KS * TC;
      for (int64_t t0 = 0; t0 < pn; t0 += TR) {
        const int r = static_cast<int>(std::min<int64_t>(TR, pn - t0));
        kMicro[r](rows.data() + p0 + t0, toff.data(), ntaps, C2, B, acc.data() + t0 * q.Op + pnl * TC, q.Op);
      }
    }
    for (int64_t lp = 0; lp < pn; ++lp) {
      const int64_t p = p0 + lp;
      T* o = chan_major ? out + p : out + p * q.O;
      int32_t* ao = acc_out ? (chan_major ? acc_out + p : acc_out + p * q.O) : nullptr;
      const int64_t st = chan_major ? P : 1;
      ovf = requant_row<T>(q, acc.data() + lp * q.Op, o, st, ao, st) || ovf;
    }
  }
  return ovf;
}

Requant make_requant(int64_t O, const torch::Tensor& mult, const torch::Tensor& bias_q,
                     const torch::Tensor& bias_f, const torch::Tensor& fp_m, const torch::Tensor& fp_n,
                     int64_t rounding, double ys, int64_t zy, int64_t lo, int64_t hi) {
  Requant q;
  q.O = O;
  q.Op = (O + TC - 1) / TC * TC;
  auto chk = [&](const torch::Tensor& t, torch::ScalarType st, const char* what, bool opt) {
    if (opt && t.numel() == 0) return false;
    TORCH_CHECK(t.dim() == 1 && t.scalar_type() == st && t.is_contiguous() && t.size(0) == q.Op,
                "qconv: ", what, " must be a contiguous 1-D tensor of ", q.Op, " elements");
    return true;
  };
  chk(mult, torch::kFloat64, "mult", false);
  q.mult = mult.data_ptr<double>();
  if (chk(bias_q, torch::kInt32, "bias_q", true)) q.bias_q = bias_q.data_ptr<int32_t>();
  if (chk(bias_f, torch::kFloat32, "bias_f", true)) q.bias_f = bias_f.data_ptr<float>();
  if (chk(fp_m, torch::kInt64, "fp_m", true)) {
    chk(fp_n, torch::kInt64, "fp_n", false);
    q.fp_m = fp_m.data_ptr<int64_t>();
    q.fp_n = fp_n.data_ptr<int64_t>();
    for (int64_t c = 0; c < O; ++c) {
      TORCH_CHECK(q.fp_m[c] >= 0 && q.fp_m[c] < (int64_t(1) << 62), "qconv: multiplier out of range");
      TORCH_CHECK(q.fp_n[c] >= -62 && q.fp_n[c] <= 100, "qconv: shift out of range");
    }
  }
  TORCH_CHECK(rounding >= 0 && rounding <= 2, "qconv: rounding must be 0, 1 or 2");
  TORCH_CHECK(lo <= hi && lo >= -(int64_t(1) << 31) && hi < (int64_t(1) << 31), "qconv: bad output range");
  TORCH_CHECK(zy >= -(int64_t(1) << 24) && zy <= (int64_t(1) << 24), "qconv: bad zero point");
  q.rounding = static_cast<int>(rounding);
  q.ys = static_cast<float>(ys);
  q.zy = static_cast<int32_t>(zy);
  q.lo = static_cast<int32_t>(lo);
  q.hi = static_cast<int32_t>(hi);
  return q;
}

// code minus zero point (int16 image, S = int16) or code minus base (uint8 image, S = uint8:
// zx is then the base, 0 for uint8 codes and -128 for int8 codes)
template <typename S, typename T>
void to_hwc(const T* x, int64_t C, int64_t H, int64_t W, int32_t zx, S* dst, int64_t Wp,
            int64_t Cp, int64_t pt, int64_t pl) {
  for (int64_t y = 0; y < H; ++y) {
    S* row = dst + ((y + pt) * Wp + pl) * Cp;
    for (int64_t c = 0; c < C; ++c) {
      const T* s = x + (c * H + y) * W;
      for (int64_t xx = 0; xx < W; ++xx) row[xx * Cp + c] = static_cast<S>(int32_t(s[xx]) - zx);
    }
  }
}

// Packed weights: int16 [ceil(O/16), K/2, 16, 2] (vpmaddwd) or int8 [ceil(O/16), K/4, 16, 4]
// (vpdpbusd). Returns the number of reduction indices per k step (2 or 4).
int64_t check_b(const torch::Tensor& Bp, int64_t O) {
  const bool s8 = Bp.scalar_type() == torch::kInt8;
  TORCH_CHECK(Bp.dim() == 4 && (s8 || Bp.scalar_type() == torch::kInt16) && Bp.is_contiguous() &&
                  Bp.size(0) == (O + TC - 1) / TC && Bp.size(2) == TC && Bp.size(3) == (s8 ? 4 : 2),
              "qconv: packed weights must be contiguous int16 [ceil(O/16), K/2, 16, 2] or int8 "
              "[ceil(O/16), K/4, 16, 4]");
#ifndef DAL_NPU_VNNI
  TORCH_CHECK(!s8, "qconv: int8 weight panels need a build with AVX-VNNI");
#endif
  return s8 ? 4 : 2;
}

torch::ScalarType out_type(int64_t code) {
  TORCH_CHECK(code >= 0 && code <= 2, "qconv: out dtype code must be 0 (int32), 1 (uint8), 2 (int8)");
  return code == 1 ? torch::kUInt8 : code == 2 ? torch::kInt8 : torch::kInt32;
}

template <typename F>
bool dispatch_out(torch::Tensor& out, F&& f) {
  switch (out.scalar_type()) {
    case torch::kUInt8: return f(out.data_ptr<uint8_t>());
    case torch::kInt8: return f(out.data_ptr<int8_t>());
    default: return f(out.data_ptr<int32_t>());
  }
}

template <typename F>
void dispatch_in(const torch::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case torch::kUInt8: f(x.data_ptr<uint8_t>()); break;
    case torch::kInt8: f(x.data_ptr<int8_t>()); break;
    case torch::kInt16: f(x.data_ptr<int16_t>()); break;
    default: TORCH_CHECK(false, "qconv: input codes must be uint8, int8 or int16");
  }
}

// VNNI offset: rows hold u = code - base in [0, 255]; padding holds uz = zx - base, so every
// position contributes (u - uz) * w and acc = sum u*w - uz * sum_k w[o, k] (corr, per channel).
struct Offset {
  int32_t base = 0, uz = 0;
  std::vector<int32_t> corr;
};

Offset make_offset(const torch::Tensor& X, int64_t zx, const torch::Tensor& wsum, int64_t Op) {
  Offset off;
  TORCH_CHECK(X.scalar_type() == torch::kUInt8 || X.scalar_type() == torch::kInt8,
              "qconv: int8 weight panels need uint8 or int8 input codes");
  off.base = X.scalar_type() == torch::kInt8 ? -128 : 0;
  off.uz = static_cast<int32_t>(zx - off.base);
  TORCH_CHECK(off.uz >= 0 && off.uz <= 255, "qconv: zero point outside the code range");
  TORCH_CHECK(wsum.dim() == 1 && wsum.scalar_type() == torch::kInt32 && wsum.is_contiguous() &&
                  wsum.size(0) == Op, "qconv: wsum must be contiguous int32 [", Op, "]");
  const int32_t* ws = wsum.data_ptr<int32_t>();
  off.corr.resize(Op);
  for (int64_t o = 0; o < Op; ++o) {
    const int64_t c = int64_t(off.uz) * ws[o];
    TORCH_CHECK(c >= INT32_MIN && c <= INT32_MAX, "qconv: reduction too long for the int8 path");
    off.corr[o] = static_cast<int32_t>(c);
  }
  return off;
}

template <typename S>
bool conv_impl(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
               int64_t O, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
               int64_t pt, int64_t pl, int64_t OH, int64_t OW, bool implicit, Requant& q,
               torch::Tensor& out, int32_t* ao, int64_t nthreads) {
  constexpr int64_t KS = 4 / sizeof(S);
  const int64_t C = X.size(0), H = X.size(1), W = X.size(2);
  // extent of the padded image the windows touch (may be less or more than H + pads)
  const int64_t Hp = std::max(pt + H, (OH - 1) * sh + (kh - 1) * dh + 1);
  const int64_t Wp = std::max(pl + W, (OW - 1) * sw + (kw - 1) * dw + 1);
  TORCH_CHECK(Hp * Wp * (C + 3) < (int64_t(1) << 30), "qconv: padded image too large");
  const int64_t Cp = implicit ? (C + KS - 1) / KS * KS : C;
  const int64_t P = OH * OW, taps = kh * kw;
  const int64_t K = implicit ? taps * Cp : (taps * C + KS - 1) / KS * KS;
  TORCH_CHECK(Bp.size(1) * KS == K, "qconv: packed weights hold ", Bp.size(1) * KS,
              " reduction indices, the geometry needs ", K);
  Offset off;
  int32_t fill = 0, sub = static_cast<int32_t>(zx);
  if constexpr (KS == 4) {
    off = make_offset(X, zx, wsum, q.Op);
    q.corr = off.corr.data();
    fill = off.uz;
    sub = off.base;
  }
  std::vector<S> img(static_cast<size_t>(Hp * Wp * Cp), static_cast<S>(fill));
  dispatch_in(X, [&](auto* x) { to_hwc<S>(x, C, H, W, sub, img.data(), Wp, Cp, pt, pl); });
  std::vector<const S*> rows(P);
  std::vector<int64_t> toff;
  std::vector<S> cols;
  int64_t C2;
  if (implicit) {
    for (int64_t oy = 0; oy < OH; ++oy)
      for (int64_t ox = 0; ox < OW; ++ox) rows[oy * OW + ox] = img.data() + ((oy * sh) * Wp + ox * sw) * Cp;
    for (int64_t i = 0; i < kh; ++i)
      for (int64_t j = 0; j < kw; ++j) toff.push_back((i * dh * Wp + j * dw) * Cp);
    C2 = Cp / KS;
  } else {
    // explicit patch matrix [P][K], k = (i*kw + j)*C + c, zero padded (zero weights) to K
    TORCH_CHECK(P * K < (int64_t(1) << 30), "qconv: patch matrix too large");
    cols.assign(static_cast<size_t>(P * K), static_cast<S>(fill));
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < P; ++p) {
      const int64_t oy = p / OW, ox = p % OW;
      S* d = cols.data() + p * K;
      const S* base = img.data() + ((oy * sh) * Wp + ox * sw) * Cp;
      for (int64_t i = 0; i < kh; ++i) {
        if (dw == 1) {  // the kw taps of a kernel row are kw*C contiguous values
          std::memcpy(d, base + i * dh * Wp * Cp, sizeof(S) * kw * C);
          d += kw * C;
        } else {
          for (int64_t j = 0; j < kw; ++j, d += C)
            std::memcpy(d, base + (i * dh * Wp + j * dw) * Cp, sizeof(S) * C);
        }
      }
    }
    for (int64_t p = 0; p < P; ++p) rows[p] = cols.data() + p * K;
    toff.push_back(0);
    C2 = K / KS;
  }
  using WT = std::conditional_t<sizeof(S) == 1, int8_t, int16_t>;
  return dispatch_out(out, [&](auto* o) {
    return run_core(rows, toff, C2, Bp.data_ptr<WT>(), q, o, true, ao, nthreads);
  });
}

template <typename S>
bool gemm_impl(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
               Requant& q, torch::Tensor& out, int32_t* ao, int64_t nthreads) {
  constexpr int64_t KS = 4 / sizeof(S);
  const int64_t M = X.size(0), Kx = X.size(1), K = (Kx + KS - 1) / KS * KS;
  TORCH_CHECK(Bp.size(1) * KS == K, "qgemm: packed weights hold ", Bp.size(1) * KS,
              " reduction indices, X has ", Kx);
  TORCH_CHECK(M * K < (int64_t(1) << 31), "qgemm: input too large");
  Offset off;
  int32_t fill = 0, sub = static_cast<int32_t>(zx);
  if constexpr (KS == 4) {
    off = make_offset(X, zx, wsum, q.Op);
    q.corr = off.corr.data();
    fill = off.uz;
    sub = off.base;
  }
  std::vector<S> a(static_cast<size_t>(M * K), static_cast<S>(fill));
  dispatch_in(X, [&](auto* x) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < Kx; ++k) a[m * K + k] = static_cast<S>(int32_t(x[m * Kx + k]) - sub);
  });
  std::vector<const S*> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = a.data() + m * K;
  if (M == 0) return false;
  using WT = std::conditional_t<sizeof(S) == 1, int8_t, int16_t>;
  return dispatch_out(out, [&](auto* o) {
    return run_core(rows, std::vector<int64_t>{0}, K / KS, Bp.data_ptr<WT>(), q, o, false, ao, nthreads);
  });
}

}  // namespace

torch::Tensor qconv(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
                    int64_t O, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                    int64_t pt, int64_t pl, int64_t OH, int64_t OW, bool implicit,
                    const torch::Tensor& mult, const torch::Tensor& bias_q, const torch::Tensor& bias_f,
                    const torch::Tensor& fp_m, const torch::Tensor& fp_n, int64_t rounding, double ys,
                    int64_t zy, int64_t lo, int64_t hi, int64_t out_code, const torch::Tensor& acc_out,
                    int64_t nthreads) {
  TORCH_CHECK(X.dim() == 3 && X.is_contiguous(), "qconv: X must be contiguous codes [C, H, W]");
  TORCH_CHECK(kh >= 1 && kw >= 1 && kh <= 4096 && kw <= 4096, "qconv: bad kernel size");
  TORCH_CHECK(sh >= 1 && sw >= 1 && dh >= 1 && dw >= 1 && sh < (1 << 16) && sw < (1 << 16) &&
                  dh < (1 << 16) && dw < (1 << 16), "qconv: strides and dilations must be in [1, 65535]");
  TORCH_CHECK(pt >= 0 && pl >= 0 && pt < (1 << 16) && pl < (1 << 16), "qconv: bad pads");
  TORCH_CHECK(OH >= 1 && OW >= 1 && OH < (1 << 24) && OW < (1 << 24), "qconv: bad output size");
  TORCH_CHECK(O >= 1 && zx >= -65536 && zx <= 65536, "qconv: bad O or zero point");
  const int64_t ks = check_b(Bp, O);
  Requant q = make_requant(O, mult, bias_q, bias_f, fp_m, fp_n, rounding, ys, zy, lo, hi);
  nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024));
  const int64_t P = OH * OW;
  auto out = torch::empty({O, P}, torch::dtype(out_type(out_code)));
  int32_t* ao = nullptr;
  if (acc_out.numel() > 0) {
    TORCH_CHECK(acc_out.scalar_type() == torch::kInt32 && acc_out.is_contiguous() && acc_out.numel() == O * P,
                "qconv: acc_out must be contiguous int32 with O*P elements");
    ao = acc_out.data_ptr<int32_t>();
  }
  const bool ovf = ks == 4
      ? conv_impl<uint8_t>(X, zx, Bp, wsum, O, kh, kw, sh, sw, dh, dw, pt, pl, OH, OW, implicit, q, out, ao, nthreads)
      : conv_impl<int16_t>(X, zx, Bp, wsum, O, kh, kw, sh, sw, dh, dw, pt, pl, OH, OW, implicit, q, out, ao, nthreads);
  TORCH_CHECK(!ovf, "accumulator plus bias overflows int32");
  return out;
}

torch::Tensor qgemm(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
                    int64_t O, const torch::Tensor& mult, const torch::Tensor& bias_q,
                    const torch::Tensor& bias_f, const torch::Tensor& fp_m, const torch::Tensor& fp_n,
                    int64_t rounding, double ys, int64_t zy, int64_t lo, int64_t hi, int64_t out_code,
                    const torch::Tensor& acc_out, int64_t nthreads) {
  TORCH_CHECK(X.dim() == 2 && X.is_contiguous(), "qgemm: X must be contiguous codes [M, K]");
  TORCH_CHECK(O >= 1 && zx >= -65536 && zx <= 65536, "qgemm: bad O or zero point");
  const int64_t ks = check_b(Bp, O);
  Requant q = make_requant(O, mult, bias_q, bias_f, fp_m, fp_n, rounding, ys, zy, lo, hi);
  nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024));
  const int64_t M = X.size(0);
  auto out = torch::empty({M, O}, torch::dtype(out_type(out_code)));
  int32_t* ao = nullptr;
  if (acc_out.numel() > 0) {
    TORCH_CHECK(acc_out.scalar_type() == torch::kInt32 && acc_out.is_contiguous() && acc_out.numel() == O * M,
                "qgemm: acc_out must be contiguous int32 with M*O elements");
    ao = acc_out.data_ptr<int32_t>();
  }
  const bool ovf = ks == 4 ? gemm_impl<uint8_t>(X, zx, Bp, wsum, q, out, ao, nthreads)
                           : gemm_impl<int16_t>(X, zx, Bp, wsum, q, out, ao, nthreads);
  TORCH_CHECK(!ovf, "accumulator plus bias overflows int32");
  return out;
}

bool has_vnni_build() {
#ifdef DAL_NPU_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace dal_npu
