// The blocked linear's exact block sums and float64 combine (see blocked_gemm.h for the contract).
//
// A tile is R rows x 16 columns (one panel; R up to 8 for avx512_vnni, whose 8 rows are 8
// independent vpdpbusd chains, else 4). For each block b in ascending order the tile's int32 block
// sums are formed in registers (vpdpbusd or vpmaddwd over the block's B inputs), corrected for
// the activation offset, converted to float64 (exact), multiplied by s_b (exact: a 29-bit integer
// times a 24-bit significand) and added to the tile's float64 sums t: the order of the definition,
// one rounding per addition. avx512_vnni does the multiply and the add as one fused multiply-add:
// the product being exact, its one rounding is the add's. Every variant thus performs the same
// IEEE additions on the same values in the same order, so all agree bit for bit with each other
// and with blocked_groups.py's numpy path.
#include "blocked_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "quantize.h"

namespace dal_npu {

namespace blocked {

constexpr int PC = 16;    // columns per panel
constexpr int RMAX = 8;   // rows per tile at most (avx512_vnni: 8 independent vpdpbusd chains; the others 4)

inline int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Arguments of one tile: rows x (staged, ldx elements apart), the panel's weights of block 0 (wsb
// elements between blocks), steps per block (quads or pairs), nb blocks, and per block the
// panel's corr / ws (npc elements between blocks); then sx and where v goes: out (row r at
// out + r * ldo), its first cols (<= 16) columns.
template <typename XT, typename WT>
using TileFn = void (*)(const XT*, int64_t, const WT*, int64_t, int64_t, int64_t, const int32_t*, const double*,
                        int64_t, double, float*, int64_t, int64_t);

// t (+)= double(acc - corr) * s, the combine of one block (the first block assigns)
template <int R>
inline __attribute__((always_inline)) void combine(const uint32_t* acc, const int32_t* corr, const double* s,
                                                   double* t, bool first) {
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < PC; ++n) {
      const int32_t a = static_cast<int32_t>(acc[r * PC + n] - static_cast<uint32_t>(corr[n]));
      const double p = static_cast<double>(a) * s[n];
      t[r * PC + n] = first ? p : t[r * PC + n] + p;
    }
}

// The tile kernels (namespace micro: tests/npu/test_dispatch.py finds the target-attributed
// functions by name)
namespace micro {

// v = float32(sx * t) of the tile's first cols columns
template <int R>
inline __attribute__((always_inline)) void finish(const double* t, double sx, float* out, int64_t ldo,
                                                  int64_t cols) {
  for (int r = 0; r < R; ++r)
    for (int64_t n = 0; n < cols; ++n) out[r * ldo + n] = static_cast<float>(sx * t[r * PC + n]);
}

// ---- portable (any CPU): unsigned arithmetic, wrapping like the vector forms ----------------

template <int R>
void u8_portable(const uint8_t* x, int64_t ldx, const int8_t* W, int64_t wsb, int64_t steps, int64_t nb,
                 const int32_t* corr, const double* ws, int64_t npc, double sx, float* out, int64_t ldo,
    int64_t cols) {
  double t[R * PC];
  for (int64_t b = 0; b < nb; ++b) {
    uint32_t acc[R * PC] = {};
    const int8_t* w = W + b * wsb;
    const uint8_t* xb = x + b * steps * 4;
    for (int64_t q = 0; q < steps; ++q, w += 4 * PC)
      for (int r = 0; r < R; ++r) {
        const uint8_t* a = xb + r * ldx + 4 * q;
        for (int n = 0; n < PC; ++n)
          for (int j = 0; j < 4; ++j)
            acc[r * PC + n] += static_cast<uint32_t>(a[j]) * static_cast<uint32_t>(int32_t(w[4 * n + j]));
      }
    combine<R>(acc, corr + b * npc, ws + b * npc, t, b == 0);
  }
  finish<R>(t, sx, out, ldo, cols);
}

template <int R>
void s16_portable(const int16_t* x, int64_t ldx, const int16_t* W, int64_t wsb, int64_t steps, int64_t nb,
                  const int32_t* corr, const double* ws, int64_t npc, double sx, float* out, int64_t ldo,
    int64_t cols) {
  double t[R * PC];
  for (int64_t b = 0; b < nb; ++b) {
    uint32_t acc[R * PC] = {};
    const int16_t* w = W + b * wsb;
    const int16_t* xb = x + b * steps * 2;
    for (int64_t q = 0; q < steps; ++q, w += 2 * PC)
      for (int r = 0; r < R; ++r) {
        const int16_t* a = xb + r * ldx + 2 * q;
        for (int n = 0; n < PC; ++n)
          for (int j = 0; j < 2; ++j)
            acc[r * PC + n] += static_cast<uint32_t>(int32_t(a[j])) * static_cast<uint32_t>(int32_t(w[2 * n + j]));
      }
    combine<R>(acc, corr + b * npc, ws + b * npc, t, b == 0);
  }
  finish<R>(t, sx, out, ldo, cols);
}

// ---- avx2: vpmaddwd on int16 pairs, two ymm per row ------------------------------------------

template <int R>
DAL_TARGET_AVX2 void s16_avx2(const int16_t* x, int64_t ldx, const int16_t* W, int64_t wsb, int64_t steps,
                              int64_t nb, const int32_t* corr, const double* ws, int64_t npc, double sx, float* out, int64_t ldo,
    int64_t cols) {
  double t[R * PC];
  for (int64_t b = 0; b < nb; ++b) {
    __m256i a0[R], a1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
    const int16_t* w = W + b * wsb;
    const int16_t* xb = x + b * steps * 2;
    for (int64_t q = 0; q < steps; ++q, w += 2 * PC) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_set1_epi32(load4(xb + r * ldx + 2 * q));
        a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(a, w0));
        a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(a, w1));
      }
    }
    alignas(32) uint32_t acc[R * PC];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(acc + r * PC), a0[r]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(acc + r * PC + 8), a1[r]);
    }
    combine<R>(acc, corr + b * npc, ws + b * npc, t, b == 0);
  }
  finish<R>(t, sx, out, ldo, cols);
}

// ---- avx_vnni: vpdpbusd on ymm, two per row --------------------------------------------------

template <int R>
DAL_TARGET_AVXVNNI void u8_avxvnni(const uint8_t* x, int64_t ldx, const int8_t* W, int64_t wsb, int64_t steps,
                                   int64_t nb, const int32_t* corr, const double* ws, int64_t npc, double sx, float* out, int64_t ldo,
    int64_t cols) {
  double t[R * PC];
  for (int64_t b = 0; b < nb; ++b) {
    __m256i a0[R], a1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
    const int8_t* w = W + b * wsb;
    const uint8_t* xb = x + b * steps * 4;
    for (int64_t q = 0; q < steps; ++q, w += 4 * PC) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_set1_epi32(load4(xb + r * ldx + 4 * q));
        a0[r] = _mm256_dpbusd_avx_epi32(a0[r], a, w0);
        a1[r] = _mm256_dpbusd_avx_epi32(a1[r], a, w1);
      }
    }
    alignas(32) uint32_t acc[R * PC];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(acc + r * PC), a0[r]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(acc + r * PC + 8), a1[r]);
    }
    combine<R>(acc, corr + b * npc, ws + b * npc, t, b == 0);
  }
  finish<R>(t, sx, out, ldo, cols);
}

// ---- avx512_vnni: vpdpbusd on zmm, one per row; the float64 sums stay in registers -----------

// acc += u8 quads of u x s8 quads of w, in place: GCC 12 copies the accumulator of the
// _mm512_dpbusd_epi32 intrinsic to another register on every step (two moves per vpdpbusd)
DAL_TARGET_AVX512VNNI inline __attribute__((always_inline)) void dpbusd(__m512i& acc, __m512i u, __m512i w) {
  __asm__("vpdpbusd %[w], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [w] "v"(w));
}

// Named registers, not arrays (GCC copies array-held accumulators between registers on every
// step); BG_ROWS(M) expands M for rows 0..7, each guarded by R > r.
#define BG_ROWS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
template <int R>
DAL_TARGET_AVX512VNNI void u8_avx512(const uint8_t* x, int64_t ldx, const int8_t* W, int64_t wsb, int64_t steps,
                                     int64_t nb, const int32_t* corr, const double* ws, int64_t npc, double sx,
                                     float* out, int64_t ldo, int64_t cols) {
#define BG_DECL(r)                                                  \
  __m512d t##r##0 = _mm512_setzero_pd(), t##r##1 = t##r##0;        \
  const uint8_t* x##r = x + (R > r ? r : 0) * ldx;
  BG_ROWS(BG_DECL)
#undef BG_DECL
  for (int64_t b = 0; b < nb; ++b) {
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    const int8_t* w = W + b * wsb;
    const int64_t off = b * steps * 4;
    for (int64_t q = 0; q < steps; ++q, w += 4 * PC) {
      const __m512i wv = _mm512_loadu_si512(w);
      const int64_t o = off + 4 * q;
#define BG_DP(r) \
  if (R > r) dpbusd(c##r, _mm512_set1_epi32(load4(x##r + o)), wv);
      BG_ROWS(BG_DP)
#undef BG_DP
    }
    const __m512i cb = _mm512_loadu_si512(corr + b * npc);
    const __m512d s0 = _mm512_loadu_pd(ws + b * npc), s1 = _mm512_loadu_pd(ws + b * npc + 8);
    // one fused multiply-add per lane after the first block: acc_b s_b is exact, so its one
    // rounding is the add's
#define BG_COMBINE(r)                                                            \
  if (R > r) {                                                                   \
    const __m512i a = _mm512_sub_epi32(c##r, cb);                                \
    const __m512d d0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(a));            \
    const __m512d d1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a, 1));      \
    t##r##0 = b == 0 ? _mm512_mul_pd(d0, s0) : _mm512_fmadd_pd(d0, s0, t##r##0); \
    t##r##1 = b == 0 ? _mm512_mul_pd(d1, s1) : _mm512_fmadd_pd(d1, s1, t##r##1); \
  }
    BG_ROWS(BG_COMBINE)
#undef BG_COMBINE
  }
  const __m512d vsx = _mm512_set1_pd(sx);
  const unsigned mask = cols >= PC ? 0xFFFFu : (1u << cols) - 1;  // masked-off lanes are not written
  const __mmask8 m0 = static_cast<__mmask8>(mask & 0xFF), m1 = static_cast<__mmask8>(mask >> 8);
#define BG_STORE(r)                                                                            \
  if (R > r) {                                                                                 \
    _mm256_mask_storeu_ps(out + r * ldo, m0, _mm512_cvtpd_ps(_mm512_mul_pd(t##r##0, vsx)));    \
    _mm256_mask_storeu_ps(out + r * ldo + 8, m1, _mm512_cvtpd_ps(_mm512_mul_pd(t##r##1, vsx))); \
  }
  BG_ROWS(BG_STORE)
#undef BG_STORE
}
#undef BG_ROWS

}  // namespace micro

// ---- requantizer of v (ONNX QuantizeLinear, as blocked_groups.py's BlockedStep.run) ---------

template <typename XT, typename WT>
struct Kernels {
  TileFn<XT, WT> fn[RMAX + 1];
  int rows;  // rows per tile of this variant (fn[1..rows] exist)
};

Kernels<uint8_t, int8_t> u8_kernels(int isa) {
  using namespace micro;
  if (isa >= kAvx512Vnni)
    return {{nullptr, u8_avx512<1>, u8_avx512<2>, u8_avx512<3>, u8_avx512<4>, u8_avx512<5>, u8_avx512<6>,
             u8_avx512<7>, u8_avx512<8>}, 8};
  if (isa == kAvxVnni) return {{nullptr, u8_avxvnni<1>, u8_avxvnni<2>, u8_avxvnni<3>, u8_avxvnni<4>}, 4};
  return {{nullptr, u8_portable<1>, u8_portable<2>, u8_portable<3>, u8_portable<4>}, 4};
}

Kernels<int16_t, int16_t> s16_kernels(int isa) {
  using namespace micro;
  if (isa >= kAvx2) return {{nullptr, s16_avx2<1>, s16_avx2<2>, s16_avx2<3>, s16_avx2<4>}, 4};
  return {{nullptr, s16_portable<1>, s16_portable<2>, s16_portable<3>, s16_portable<4>}, 4};
}

// v [M, N] float32 from staged rows xs [M, ldx]: tiles of R rows x one panel, panel-major
template <typename XT, typename WT>
void run_tiles(const Kernels<XT, WT>& k, const XT* xs, int64_t ldx, const WT* W, int64_t NP, int64_t steps,
               int64_t ks, int64_t nb, const int32_t* corr, const double* ws, int64_t M, int64_t N, double sx,
               float* v, int64_t nthreads) {
  const int64_t npc = NP * PC, wsb = NP * steps * ks * PC, wsp = steps * ks * PC;
  const int64_t rt = k.rows, nrt = (M + rt - 1) / rt, tasks = NP * nrt;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && tasks > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t p = task / nrt, m0 = (task % nrt) * rt;
    const int rows = static_cast<int>(std::min<int64_t>(rt, M - m0));
    const int64_t n0 = p * PC, cols = std::min<int64_t>(PC, N - n0);
    k.fn[rows](xs + m0 * ldx, ldx, W + p * wsp, wsb, steps, nb, corr + p * PC, ws + p * PC, npc, sx,
               v + m0 * N + n0, N, cols);
  }
}

}  // namespace blocked

std::vector<torch::Tensor> blocked_gemm(const torch::Tensor& X, int64_t zx, const torch::Tensor& Wp,
                                        const torch::Tensor& wsum, const torch::Tensor& ws, int64_t B,
                                        int64_t N, double sx, const torch::Tensor& ys, const torch::Tensor& zy,
                                        const torch::Tensor& lo, const torch::Tensor& hi,
                                        const torch::Tensor& out_code, int64_t nthreads, int64_t isa) {
  using namespace blocked;
  TORCH_CHECK(X.dim() == 2 && X.is_contiguous() && (X.scalar_type() == torch::kUInt8 || X.scalar_type() == torch::kInt8),
              "blocked_gemm: X must be contiguous uint8 or int8 codes [M, K]");
  const bool s8 = Wp.scalar_type() == torch::kInt8;
  TORCH_CHECK(Wp.dim() == 5 && Wp.is_contiguous() && (s8 || Wp.scalar_type() == torch::kInt16) &&
                  Wp.size(3) == PC && Wp.size(4) == (s8 ? 4 : 2),
              "blocked_gemm: Wp must be contiguous int8 [nb, NP, Bq, 16, 4] or int16 [nb, NP, Bh, 16, 2]");
  const int64_t M = X.size(0), K = X.size(1), nb = Wp.size(0), NP = Wp.size(1), steps = Wp.size(2);
  const int64_t ks = s8 ? 4 : 2;
  TORCH_CHECK(B >= 1 && B <= (int64_t(1) << 20) && nb >= 1 && K >= 1 && (nb - 1) * B < K && K <= nb * B,
              "blocked_gemm: ", nb, " blocks of ", B, " do not cover the ", K, " input channels");
  TORCH_CHECK(steps == (B + ks - 1) / ks, "blocked_gemm: the packed blocks hold ", steps * ks,
              " rows, a block of ", B, " needs ", (B + ks - 1) / ks * ks);
  TORCH_CHECK(N >= 1 && NP == (N + PC - 1) / PC, "blocked_gemm: ", NP, " panels do not hold ", N, " columns");
  TORCH_CHECK(ws.scalar_type() == torch::kFloat64 && ws.is_contiguous() && ws.dim() == 2 && ws.size(0) == nb &&
                  ws.size(1) == NP * PC,
              "blocked_gemm: ws must be contiguous float64 [nb, NP * 16]");
  TORCH_CHECK(!s8 || (wsum.scalar_type() == torch::kInt32 && wsum.is_contiguous() && wsum.dim() == 2 &&
                      wsum.size(0) == nb && wsum.size(1) == NP * PC),
              "blocked_gemm: the int8 form needs wsum, contiguous int32 [nb, NP * 16]");
  TORCH_CHECK(zx >= -65536 && zx <= 65536, "blocked_gemm: zero point out of range");
  TORCH_CHECK(M < (int64_t(1) << 31) / std::max<int64_t>(1, nb * steps * ks) && M * N < (int64_t(1) << 40),
              "blocked_gemm: input too large");
  const int64_t R = ys.numel();
  auto vec_ok = [&](const torch::Tensor& a) {
    return a.scalar_type() == torch::kInt64 && a.is_contiguous() && a.numel() == R;
  };
  TORCH_CHECK(ys.scalar_type() == torch::kFloat32 && ys.is_contiguous() && vec_ok(zy) && vec_ok(lo) && vec_ok(hi) &&
                  vec_ok(out_code),
              "blocked_gemm: readers need ys float32 [R] and zy, lo, hi, out_code int64 [R]");
  for (int64_t r = 0; r < R; ++r) {
    const float s = ys.data_ptr<float>()[r];
    const int64_t oc = out_code.data_ptr<int64_t>()[r], z = zy.data_ptr<int64_t>()[r];
    const int64_t l = lo.data_ptr<int64_t>()[r], h = hi.data_ptr<int64_t>()[r];
    TORCH_CHECK(std::isfinite(s) && s > 0, "blocked_gemm: reader ", r, ": scale must be finite and > 0");
    TORCH_CHECK(oc == 1 || oc == 2, "blocked_gemm: reader ", r, ": out_code must be 1 (uint8) or 2 (int8)");
    const int64_t qmin = oc == 1 ? 0 : -128, qmax = oc == 1 ? 255 : 127;
    TORCH_CHECK(z >= qmin && z <= qmax && qmin <= l && l <= h && h <= qmax,
                "blocked_gemm: reader ", r, ": zero point or [lo, hi] outside the code range");
  }
  const int v = isa_resolve(isa);
  nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024));

  // the activation codes staged per block: u = code - base (int8 form), code - zx (int16 form);
  // the padding rows of each block read 0 (their weights are 0)
  const bool u8in = X.scalar_type() == torch::kUInt8;
  const int64_t base = s8 ? (u8in ? 0 : -128) : zx, bp = steps * ks, ldx = nb * bp;
  const int64_t uz = zx - base;  // int8 form: acc = sum u w - uz wsum
  std::vector<int32_t> corr(static_cast<size_t>(nb * NP * PC), 0);
  if (s8) {
    const int32_t* s = wsum.data_ptr<int32_t>();
    for (size_t i = 0; i < corr.size(); ++i)
      corr[i] = static_cast<int32_t>(static_cast<uint32_t>(uz) * static_cast<uint32_t>(s[i]));
  }
  auto stage = [&](auto* xs) {
    using T = std::remove_pointer_t<decltype(xs)>;
    auto fill = [&](const auto* x) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t k0 = b * B, kn = std::min(B, K - k0);
          T* d = xs + m * ldx + b * bp;
          const auto* s = x + m * K + k0;
          for (int64_t j = 0; j < kn; ++j) d[j] = static_cast<T>(int32_t(s[j]) - base);
        }
    };
    if (u8in)
      fill(X.data_ptr<uint8_t>());
    else
      fill(X.data_ptr<int8_t>());
  };
  auto vt = torch::empty({M, N}, torch::kFloat32);
  float* vp = vt.data_ptr<float>();
  const double* wsp = ws.data_ptr<double>();
  if (s8) {
    std::vector<uint8_t> xs(static_cast<size_t>(M * ldx), 0);
    stage(xs.data());
    run_tiles(u8_kernels(v), xs.data(), ldx, Wp.data_ptr<int8_t>(), NP, steps, ks, nb, corr.data(), wsp, M, N, sx,
              vp, nthreads);
  } else {
    TORCH_CHECK(zx >= -32768 + 255 && zx <= 32767 - 255, "blocked_gemm: zero point out of the int16 form's range");
    std::vector<int16_t> xs(static_cast<size_t>(M * ldx), 0);
    stage(xs.data());
    run_tiles(s16_kernels(v), xs.data(), ldx, Wp.data_ptr<int16_t>(), NP, steps, ks, nb, corr.data(), wsp, M, N,
              sx, vp, nthreads);
  }
  if (R == 0) return {vt};
  std::vector<torch::Tensor> outs;
  std::vector<int32_t> q(static_cast<size_t>(M * N));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t oc = out_code.data_ptr<int64_t>()[r];
    const int32_t z = static_cast<int32_t>(zy.data_ptr<int64_t>()[r]);
    const float l = float(lo.data_ptr<int64_t>()[r] - z), h = float(hi.data_ptr<int64_t>()[r] - z);
    const float s = ys.data_ptr<float>()[r];
    const bool nan = v >= kAvx2 ? quant_avx2(vp, M * N, s, l, h, z, q.data())  // QuantizeLinear (quantize.h)
                                : quant_scalar(vp, M * N, s, l, h, z, q.data());
    TORCH_CHECK(!nan, "blocked_gemm: v / ys is NaN");
    auto o = torch::empty({M, N}, torch::dtype(oc == 1 ? torch::kUInt8 : torch::kInt8));
    if (oc == 1) {
      uint8_t* d = o.data_ptr<uint8_t>();
      for (int64_t i = 0; i < M * N; ++i) d[i] = static_cast<uint8_t>(q[i]);
    } else {
      int8_t* d = o.data_ptr<int8_t>();
      for (int64_t i = 0; i < M * N; ++i) d[i] = static_cast<int8_t>(q[i]);
    }
    outs.push_back(o);
  }
  return outs;
}

}  // namespace dal_npu
