// Micro kernels of qconv.cpp: C[r][0..W) = sum over taps t and k steps of the row r's
// activations at rp[r] + toff[t] against packed weight panels, W = 16 channels per panel.
//
//   int16 rows (code - zero point) x int16 panels [K/2][16][2]   vpmaddwd   (portable, avx2)
//   uint8 rows (code - base)       x int8 panels  [K/4][16][4]   vpdpbusd   (portable,
//                                                                 avx_vnni ymm, avx512_vnni zmm:
//                                                                 1, 2 or 4 panels per tile)
// Every form sums the same products exactly in int32 (vpmaddwd pairs of int16 products and
// vpdpbusd quads of u8 x s8 products cannot saturate), so all variants agree bit for bit.
// Included by qconv.cpp only; each variant carries its own target attribute (isa.h).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "isa.h"

namespace dal_npu {
namespace micro {

constexpr int TR = 6;   // pixels per micro tile
constexpr int TC = 16;  // output channels per panel

inline int32_t quad_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Signature shared by all kernels; two-panel kernels also write channels 16..31 of each row
// from the panel at B + bstride. add: C += the sums (a later chunk of the reduction), else C =.
// Last: a prefetch address, read by the four-panel kernel only (u8_avx512_wide), else ignored.
template <typename E, typename WT>
using Fn = void (*)(const E* const*, const int64_t*, int64_t, int64_t, const WT*, int64_t, int32_t*, int64_t, bool,
                    const void*);

template <int R>
void s16_portable(const int16_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C2,
                  const int16_t* B, int64_t, int32_t* C, int64_t ldc, bool add, const void*) {
  int32_t acc[TR][TC] = {};
  for (int64_t t = 0; t < ntaps; ++t)
    for (int64_t c2 = 0; c2 < C2; ++c2, B += 2 * TC)
      for (int r = 0; r < R; ++r) {
        const int16_t* a = rp[r] + toff[t] + 2 * c2;
        const int32_t x0 = a[0], x1 = a[1];
        for (int n = 0; n < TC; ++n) acc[r][n] += x0 * int32_t(B[2 * n]) + x1 * int32_t(B[2 * n + 1]);
      }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < TC; ++n) C[r * ldc + n] = (add ? C[r * ldc + n] : 0) + acc[r][n];
}

template <int R>
void u8_portable(const uint8_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C4,
                 const int8_t* B, int64_t, int32_t* C, int64_t ldc, bool add, const void*) {
  int32_t acc[TR][TC] = {};
  for (int64_t t = 0; t < ntaps; ++t)
    for (int64_t c4 = 0; c4 < C4; ++c4, B += 4 * TC)
      for (int r = 0; r < R; ++r) {
        const uint8_t* a = rp[r] + toff[t] + 4 * c4;
        for (int n = 0; n < TC; ++n)
          for (int j = 0; j < 4; ++j) acc[r][n] += int32_t(a[j]) * int32_t(B[4 * n + j]);
      }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < TC; ++n) C[r * ldc + n] = (add ? C[r * ldc + n] : 0) + acc[r][n];
}

// Named accumulators (not arrays): GCC keeps them in registers; arrays of vectors spill.
#define DAL_ROWPTRS                                  \
  const int64_t o = toff[t];                         \
  const auto* a0 = rp[0] + o;                        \
  const auto* a1 = R > 1 ? rp[1] + o : a0;           \
  const auto* a2 = R > 2 ? rp[2] + o : a0;           \
  const auto* a3 = R > 3 ? rp[3] + o : a0;           \
  const auto* a4 = R > 4 ? rp[4] + o : a0;           \
  const auto* a5 = R > 5 ? rp[5] + o : a0;
#define DAL_ALL_ROWS(M) M(0) M(1) M(2) M(3) M(4) M(5)

template <int R>
DAL_TARGET_AVX2 void s16_avx2(const int16_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C2,
                              const int16_t* B, int64_t, int32_t* C, int64_t ldc, bool add, const void*) {
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t t = 0; t < ntaps; ++t) {
    DAL_ROWPTRS
    for (int64_t c2 = 0; c2 < C2; ++c2, B += 2 * TC) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + 16));
#define DAL_ROW(r)                                                   \
  if (R > r) {                                                       \
    const __m256i a = _mm256_set1_epi32(quad_at(a##r + 2 * c2));     \
    c##r##0 = _mm256_add_epi32(c##r##0, _mm256_madd_epi16(a, b0));   \
    c##r##1 = _mm256_add_epi32(c##r##1, _mm256_madd_epi16(a, b1));   \
  }
      DAL_ALL_ROWS(DAL_ROW)
#undef DAL_ROW
    }
  }
#define DAL_ST(r)                                                                  \
  if (R > r) {                                                                     \
    __m256i* p0 = reinterpret_cast<__m256i*>(C + r * ldc);                         \
    __m256i* p1 = reinterpret_cast<__m256i*>(C + r * ldc + 8);                     \
    if (add) {                                                                     \
      c##r##0 = _mm256_add_epi32(c##r##0, _mm256_loadu_si256(p0));                \
      c##r##1 = _mm256_add_epi32(c##r##1, _mm256_loadu_si256(p1));                 \
    }                                                                              \
    _mm256_storeu_si256(p0, c##r##0);                                              \
    _mm256_storeu_si256(p1, c##r##1);                                              \
  }
  DAL_ALL_ROWS(DAL_ST)
}

template <int R>
DAL_TARGET_AVXVNNI void u8_avxvnni(const uint8_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C4,
                                   const int8_t* B, int64_t, int32_t* C, int64_t ldc, bool add, const void*) {
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t t = 0; t < ntaps; ++t) {
    DAL_ROWPTRS
    for (int64_t c4 = 0; c4 < C4; ++c4, B += 4 * TC) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + 32));
#define DAL_ROW(r)                                                 \
  if (R > r) {                                                     \
    const __m256i a = _mm256_set1_epi32(quad_at(a##r + 4 * c4));   \
    c##r##0 = _mm256_dpbusd_avx_epi32(c##r##0, a, b0);             \
    c##r##1 = _mm256_dpbusd_avx_epi32(c##r##1, a, b1);             \
  }
      DAL_ALL_ROWS(DAL_ROW)
#undef DAL_ROW
    }
  }
  DAL_ALL_ROWS(DAL_ST)
}
#undef DAL_ST

// zmm, one panel: 16 channels = one register per row.
template <int R>
DAL_TARGET_AVX512VNNI void u8_avx512(const uint8_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C4,
                                     const int8_t* B, int64_t, int32_t* C, int64_t ldc, bool add, const void*) {
  __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4_ = c0, c5 = c0;
  for (int64_t t = 0; t < ntaps; ++t) {
    DAL_ROWPTRS
    for (int64_t k = 0; k < C4; ++k, B += 4 * TC) {
      const __m512i b = _mm512_loadu_si512(B);
      if (R > 0) c0 = _mm512_dpbusd_epi32(c0, _mm512_set1_epi32(quad_at(a0 + 4 * k)), b);
      if (R > 1) c1 = _mm512_dpbusd_epi32(c1, _mm512_set1_epi32(quad_at(a1 + 4 * k)), b);
      if (R > 2) c2 = _mm512_dpbusd_epi32(c2, _mm512_set1_epi32(quad_at(a2 + 4 * k)), b);
      if (R > 3) c3 = _mm512_dpbusd_epi32(c3, _mm512_set1_epi32(quad_at(a3 + 4 * k)), b);
      if (R > 4) c4_ = _mm512_dpbusd_epi32(c4_, _mm512_set1_epi32(quad_at(a4 + 4 * k)), b);
      if (R > 5) c5 = _mm512_dpbusd_epi32(c5, _mm512_set1_epi32(quad_at(a5 + 4 * k)), b);
    }
  }
#define DAL_ST1(r, v)                                                               \
  if (R > r) {                                                                      \
    if (add) v = _mm512_add_epi32(v, _mm512_loadu_si512(C + r * ldc));              \
    _mm512_storeu_si512(C + r * ldc, v);                                            \
  }
  DAL_ST1(0, c0) DAL_ST1(1, c1) DAL_ST1(2, c2) DAL_ST1(3, c3) DAL_ST1(4, c4_) DAL_ST1(5, c5)
#undef DAL_ST1
}

// zmm, two panels (32 channels): 12 accumulators, each broadcast feeds two vpdpbusd.
template <int R>
DAL_TARGET_AVX512VNNI void u8_avx512x2(const uint8_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C4,
                                       const int8_t* B, int64_t bstride, int32_t* C, int64_t ldc, bool add,
                                       const void*) {
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m512i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t t = 0; t < ntaps; ++t) {
    DAL_ROWPTRS
    for (int64_t k = 0; k < C4; ++k, B += 4 * TC) {
      const __m512i b0 = _mm512_loadu_si512(B);
      const __m512i b1 = _mm512_loadu_si512(B + bstride);
#define DAL_ROW(r)                                                 \
  if (R > r) {                                                     \
    const __m512i a = _mm512_set1_epi32(quad_at(a##r + 4 * k));    \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, a, b0);                 \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, a, b1);                 \
  }
      DAL_ALL_ROWS(DAL_ROW)
#undef DAL_ROW
    }
  }
#define DAL_ST(r)                                                                      \
  if (R > r) {                                                                         \
    if (add) {                                                                         \
      c##r##0 = _mm512_add_epi32(c##r##0, _mm512_loadu_si512(C + r * ldc));           \
      c##r##1 = _mm512_add_epi32(c##r##1, _mm512_loadu_si512(C + r * ldc + 16));      \
    }                                                                                  \
    _mm512_storeu_si512(C + r * ldc, c##r##0);                                         \
    _mm512_storeu_si512(C + r * ldc + 16, c##r##1);                                    \
  }
  DAL_ALL_ROWS(DAL_ST)
#undef DAL_ST
}
#undef DAL_ROWPTRS
#undef DAL_ALL_ROWS

// zmm, NP panels (16 * NP channels) x R pixels: R * NP accumulators (24 for 6 x 4), each
// broadcast feeds NP vpdpbusd and each weight load R of them. Fully unrolled over the
// constant bounds, so GCC keeps the arrays in registers (checked: no spills in the loop).
// pf (or null): where the NEXT weight slice's lines start, at the same offsets as B's: one line
// of it goes to L2 per k step (prefetcht1), spread over the loop -- weights streaming from L3
// (layers whose panels exceed L2: 512 channels at 7x7) then arrive before their first tile.
template <int R, int NP>
DAL_TARGET_AVX512VNNI void u8_avx512_wide(const uint8_t* const* rp, const int64_t* toff, int64_t ntaps,
                                          int64_t C4, const int8_t* B, int64_t bstride, int32_t* C,
                                          int64_t ldc, bool add, const void* pf) {
  __m512i acc[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_si512();
  // as an integer distance: the last slice's prefetches may run past the panels' end (a hint,
  // never a fault, but not a pointer C++ lets one form)
  const uintptr_t pfd = pf ? reinterpret_cast<uintptr_t>(pf) - reinterpret_cast<uintptr_t>(B) : 0;
  for (int64_t t = 0; t < ntaps; ++t) {
    const uint8_t* a[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r] = rp[r] + toff[t];
    for (int64_t k = 0; k < C4; ++k, B += 4 * TC) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(B) + pfd), _MM_HINT_T1);
      __m512i b[NP];
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) b[p] = _mm512_loadu_si512(B + p * bstride);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(quad_at(a[r] + 4 * k));
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], x, b[p]);
      }
    }
  }
  // one row pointer stepped by ldc: written as C + r * ldc + TC * p, GCC precomputed all R * NP
  // store addresses and parked them in xmm registers (~60 more instructions per call)
  int32_t* c = C;
  if (add) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r, c += ldc)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
        _mm512_storeu_si512(c + TC * p, _mm512_add_epi32(acc[r][p], _mm512_loadu_si512(c + TC * p)));
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r, c += ldc)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) _mm512_storeu_si512(c + TC * p, acc[r][p]);
  }
}
template <int R>
DAL_TARGET_AVX512VNNI void u8_avx512x4(const uint8_t* const* rp, const int64_t* toff, int64_t ntaps, int64_t C4,
                                       const int8_t* B, int64_t bstride, int32_t* C, int64_t ldc, bool add,
                                       const void* pf) {
  u8_avx512_wide<R, 4>(rp, toff, ntaps, C4, B, bstride, C, ldc, add, pf);
}

// A variant's kernels: one[r] (16 channels) and, where it has them, two[r] (32 channels) and
// four[r] (64 channels; panels at B + p * bstride).
template <typename E, typename WT>
struct Kernels {
  Fn<E, WT> one[TR + 1];
  Fn<E, WT> two[TR + 1];   // all null: no two-panel form
  Fn<E, WT> four[TR + 1];  // all null: no four-panel form
  int widest() const { return four[1] ? 4 : two[1] ? 2 : 1; }
};

#define DAL_TABLE(f) {nullptr, f<1>, f<2>, f<3>, f<4>, f<5>, f<6>}
#define DAL_NONE {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr}
inline const Kernels<int16_t, int16_t>& kernels_s16(int isa) {
  static const Kernels<int16_t, int16_t> port{DAL_TABLE(s16_portable), DAL_NONE, DAL_NONE};
  static const Kernels<int16_t, int16_t> avx2{DAL_TABLE(s16_avx2), DAL_NONE, DAL_NONE};
  return isa_has_avx2(isa) ? avx2 : port;
}
inline const Kernels<uint8_t, int8_t>& kernels_u8(int isa) {
  static const Kernels<uint8_t, int8_t> port{DAL_TABLE(u8_portable), DAL_NONE, DAL_NONE};
  static const Kernels<uint8_t, int8_t> vnni{DAL_TABLE(u8_avxvnni), DAL_NONE, DAL_NONE};
  static const Kernels<uint8_t, int8_t> zmm{DAL_TABLE(u8_avx512), DAL_TABLE(u8_avx512x2), DAL_TABLE(u8_avx512x4)};
  return isa_has_avx512(isa) ? zmm : isa == kAvxVnni ? vnni : port;  // amx_int8: zmm for the rest
}
#undef DAL_TABLE
#undef DAL_NONE

}  // namespace micro
}  // namespace dal_npu
