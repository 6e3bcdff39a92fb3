// Exact int16 x int16 -> int32 GEMM (dense and 2:4 sparse). See gemm_s16.h for the contract.
#include "gemm_s16.h"

#include <algorithm>
#include <cstring>
#include <vector>
#include <immintrin.h>

#include "isa.h"

namespace dal_npu {

static inline int32_t load_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);  // two consecutive int16 (k, k+1) as one int32 lane for vpmaddwd
  return v;
}

namespace {

constexpr int MR = 4;   // rows of A per micro tile
constexpr int NR = 24;  // columns per micro tile (3 vectors of 8 int32)

using MicroFn = void (*)(const int16_t*, int64_t, const int16_t*, int64_t, int64_t, int32_t*,
                         int64_t, int64_t);

// AVX2 forms carry their target attribute (isa.h); which form runs is decided per call from
// the CPU (cpu_supports_isa), never from the build machine.
// 12 int32x8 accumulators + 3 B vectors + 1 broadcast = 16 ymm registers.
template <int R, int V>
DAL_TARGET_AVX2 void micro_avx2(const int16_t* A, int64_t lda, const int16_t* B, int64_t ldb, int64_t K2, int32_t* C,
           int64_t ldc, int64_t ncols) {
  __m256i acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const int16_t* b = B + k2 * ldb;
    __m256i bv[V];
    for (int v = 0; v < V; ++v) bv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * v));
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_set1_epi32(load_pair(A + r * lda + 2 * k2));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(a, bv[v]));
    }
  }
  for (int r = 0; r < R; ++r) {
    if (ncols == 8 * V) {
      for (int v = 0; v < V; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + 8 * v), acc[r][v]);
    } else {
      alignas(32) int32_t tmp[8 * V];
      for (int v = 0; v < V; ++v) _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8 * v), acc[r][v]);
      std::memcpy(C + r * ldc, tmp, sizeof(int32_t) * ncols);
    }
  }
}
// The full 4x24 tile with named accumulators: GCC keeps these in ymm registers, whereas the
// array form above spills them to the stack (measured 29 GOP/s vs ~3x that).
DAL_TARGET_AVX2 void micro_4x3(const int16_t* A, int64_t lda, const int16_t* B, int64_t ldb, int64_t K2, int32_t* C,
               int64_t ldc, int64_t ncols) {
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
  __m256i c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
  const int16_t *a0 = A, *a1 = A + lda, *a2 = A + 2 * lda, *a3 = A + 3 * lda;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const int16_t* b = B + k2 * ldb;
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
    __m256i a = _mm256_set1_epi32(load_pair(a0 + 2 * k2));
    c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(a, b0));
    c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(a, b1));
    c02 = _mm256_add_epi32(c02, _mm256_madd_epi16(a, b2));
    a = _mm256_set1_epi32(load_pair(a1 + 2 * k2));
    c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(a, b0));
    c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(a, b1));
    c12 = _mm256_add_epi32(c12, _mm256_madd_epi16(a, b2));
    a = _mm256_set1_epi32(load_pair(a2 + 2 * k2));
    c20 = _mm256_add_epi32(c20, _mm256_madd_epi16(a, b0));
    c21 = _mm256_add_epi32(c21, _mm256_madd_epi16(a, b1));
    c22 = _mm256_add_epi32(c22, _mm256_madd_epi16(a, b2));
    a = _mm256_set1_epi32(load_pair(a3 + 2 * k2));
    c30 = _mm256_add_epi32(c30, _mm256_madd_epi16(a, b0));
    c31 = _mm256_add_epi32(c31, _mm256_madd_epi16(a, b1));
    c32 = _mm256_add_epi32(c32, _mm256_madd_epi16(a, b2));
  }
  const __m256i rows[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
  for (int r = 0; r < 4; ++r) {
    alignas(32) int32_t tmp[24];
    for (int v = 0; v < 3; ++v) _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8 * v), rows[r][v]);
    std::memcpy(C + r * ldc, tmp, sizeof(int32_t) * ncols);
  }
}
template <int R, int V>
void micro_portable(const int16_t* A, int64_t lda, const int16_t* B, int64_t ldb, int64_t K2, int32_t* C,
           int64_t ldc, int64_t ncols) {
  int32_t acc[R][8 * V] = {};
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const int16_t* b = B + k2 * ldb;
    for (int r = 0; r < R; ++r) {
      const int32_t a0 = A[r * lda + 2 * k2], a1 = A[r * lda + 2 * k2 + 1];
      for (int n = 0; n < 8 * V; ++n) acc[r][n] += a0 * int32_t(b[2 * n]) + a1 * int32_t(b[2 * n + 1]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(C + r * ldc, acc[r], sizeof(int32_t) * ncols);
}

template <int R>
MicroFn pick_v(int v, bool avx2) {
  if (avx2) return v == 1 ? micro_avx2<R, 1> : v == 2 ? micro_avx2<R, 2> : micro_avx2<R, 3>;
  return v == 1 ? micro_portable<R, 1> : v == 2 ? micro_portable<R, 2> : micro_portable<R, 3>;
}
MicroFn pick(int r, int v, bool avx2) {
  switch (r) {
    case 1: return pick_v<1>(v, avx2);
    case 2: return pick_v<2>(v, avx2);
    case 3: return pick_v<3>(v, avx2);
    default:
      if (avx2 && v == 3) return micro_4x3;
      return pick_v<4>(v, avx2);
  }
}

// One row of the 2:4 sparse product on AVX2: only the two kept rows of each group are
// touched; vpmaddwd on the interleaved rows is exact.
DAL_TARGET_AVX2 void sparse_row_avx2(const int16_t* v, const uint8_t* ps, const int16_t* b, int64_t G,
                                     int64_t Np, int64_t n0, int64_t ncols, int32_t* out) {
  const int nchunks = static_cast<int>((ncols + 15) / 16);  // Np % 16 == 0: never reads past B
  __m256i lo[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256i hi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t p = ps[g];
    const int16_t* r0 = b + (4 * g + (p & 3)) * Np + n0;
    const int16_t* r1 = b + (4 * g + ((p >> 2) & 3)) * Np + n0;
    const __m256i a = _mm256_set1_epi32(load_pair(v + g * 2));
    for (int ch = 0; ch < nchunks; ++ch) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * ch));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 16 * ch));
      lo[ch] = _mm256_add_epi32(lo[ch], _mm256_madd_epi16(a, _mm256_unpacklo_epi16(x0, x1)));
      hi[ch] = _mm256_add_epi32(hi[ch], _mm256_madd_epi16(a, _mm256_unpackhi_epi16(x0, x1)));
    }
  }
  for (int ch = 0; ch < nchunks; ++ch) {  // undo the in-lane interleave of unpack{lo,hi}
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16 * ch), _mm256_permute2x128_si256(lo[ch], hi[ch], 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16 * ch + 8), _mm256_permute2x128_si256(lo[ch], hi[ch], 0x31));
  }
}

void check_threads(int64_t& nthreads) { nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024)); }

}  // namespace

torch::Tensor gemm_s16(const torch::Tensor& A, const torch::Tensor& Bp, int64_t N, int64_t nthreads) {
  TORCH_CHECK(A.dim() == 2 && A.scalar_type() == torch::kInt16 && A.is_contiguous(),
              "gemm_s16: A must be a contiguous int16 [M, K] tensor");
  TORCH_CHECK(Bp.dim() == 3 && Bp.size(2) == 2 && Bp.scalar_type() == torch::kInt16 && Bp.is_contiguous(),
              "gemm_s16: Bp must be a contiguous int16 [K/2, Np, 2] tensor");
  const int64_t M = A.size(0), K2 = Bp.size(0), Np = Bp.size(1);
  TORCH_CHECK(A.size(1) == 2 * K2, "gemm_s16: A has ", A.size(1), " columns, Bp holds ", 2 * K2);
  TORCH_CHECK(Np % 16 == 0 && N >= 0 && N <= Np, "gemm_s16: N=", N, " must be <= Np=", Np, " (Np % 16 == 0)");
  check_threads(nthreads);
  auto C = torch::zeros({M, N}, torch::dtype(torch::kInt32));
  if (M == 0 || N == 0 || K2 == 0) return C;
  const int16_t* a = A.data_ptr<int16_t>();
  const int16_t* bsrc = Bp.data_ptr<int16_t>();
  int32_t* c = C.data_ptr<int32_t>();
  const bool avx2 = cpu_supports_isa(kAvx2);
  const int64_t npanels = (N + NR - 1) / NR, mtiles = (M + MR - 1) / MR, ntasks = npanels * mtiles;
  // Repack B panel-major ([panel][K2][24][2]) so a micro tile streams one contiguous block
  // instead of striding by Np*4 bytes per k pair (cache lines and TLB entries wasted).
  std::vector<int16_t> panels(static_cast<size_t>(npanels) * K2 * NR * 2, 0);
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t pnl = 0; pnl < npanels; ++pnl) {
    const int64_t j0 = pnl * NR, w = std::min<int64_t>(NR, Np - j0);
    int16_t* dst = panels.data() + pnl * K2 * NR * 2;
    for (int64_t k2 = 0; k2 < K2; ++k2)
      std::memcpy(dst + k2 * NR * 2, bsrc + (k2 * Np + j0) * 2, sizeof(int16_t) * 2 * w);
  }
  const int16_t* b = panels.data();
  // Panel-major task order: a thread's static chunk walks all row tiles of one B panel
  // (K x 24 int16, in L1/L2) before moving on.
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t t = 0; t < ntasks; ++t) {
    const int64_t panel = t / mtiles, tile = t % mtiles;
    const int64_t j0 = panel * NR, i0 = tile * MR;
    const int64_t ncols = std::min<int64_t>(NR, N - j0);
    const int rows = static_cast<int>(std::min<int64_t>(MR, M - i0));
    const int nv = static_cast<int>((ncols + 7) / 8);
    pick(rows, nv, avx2)(a + i0 * 2 * K2, 2 * K2, b + panel * K2 * NR * 2, 2 * NR, K2, c + i0 * N + j0, N, ncols);
  }
  return C;
}

torch::Tensor sparse24_gemm_s16(const torch::Tensor& vals, const torch::Tensor& pos,
                                const torch::Tensor& B, int64_t N, int64_t nthreads) {
  TORCH_CHECK(vals.dim() == 3 && vals.size(2) == 2 && vals.scalar_type() == torch::kInt16 && vals.is_contiguous(),
              "sparse24_gemm_s16: vals must be contiguous int16 [M, K/4, 2]");
  TORCH_CHECK(pos.dim() == 2 && pos.scalar_type() == torch::kUInt8 && pos.is_contiguous() &&
                  pos.size(0) == vals.size(0) && pos.size(1) == vals.size(1),
              "sparse24_gemm_s16: pos must be contiguous uint8 [M, K/4]");
  TORCH_CHECK(B.dim() == 2 && B.scalar_type() == torch::kInt16 && B.is_contiguous(),
              "sparse24_gemm_s16: B must be contiguous int16 [K, Np]");
  const int64_t M = vals.size(0), G = vals.size(1), Np = B.size(1);
  TORCH_CHECK(B.size(0) == 4 * G, "sparse24_gemm_s16: B has ", B.size(0), " rows, expected 4*", G);
  TORCH_CHECK(Np % 16 == 0 && N >= 0 && N <= Np, "sparse24_gemm_s16: N=", N, " Np=", Np);
  check_threads(nthreads);
  auto C = torch::zeros({M, N}, torch::dtype(torch::kInt32));
  if (M == 0 || N == 0 || G == 0) return C;
  const int16_t* v = vals.data_ptr<int16_t>();
  const uint8_t* ps = pos.data_ptr<uint8_t>();
  const int16_t* b = B.data_ptr<int16_t>();
  int32_t* c = C.data_ptr<int32_t>();
  const bool avx2 = cpu_supports_isa(kAvx2);
  const int64_t nblocks = (N + 31) / 32, ntasks = M * nblocks;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t t = 0; t < ntasks; ++t) {
    const int64_t m = t / nblocks, n0 = (t % nblocks) * 32;
    const int64_t ncols = std::min<int64_t>(32, N - n0);
    alignas(32) int32_t out[32];
    if (avx2) {
      sparse_row_avx2(v + m * G * 2, ps + m * G, b, G, Np, n0, ncols, out);
      std::memcpy(c + m * N + n0, out, sizeof(int32_t) * ncols);
      continue;
    }
    for (int n = 0; n < 32; ++n) out[n] = 0;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t p = ps[m * G + g];
      const int16_t* r0 = b + (4 * g + (p & 3)) * Np + n0;
      const int16_t* r1 = b + (4 * g + ((p >> 2) & 3)) * Np + n0;
      const int32_t a0 = v[(m * G + g) * 2], a1 = v[(m * G + g) * 2 + 1];
      for (int n = 0; n < ncols; ++n) out[n] += a0 * int32_t(r0[n]) + a1 * int32_t(r1[n]);
    }
    std::memcpy(c + m * N + n0, out, sizeof(int32_t) * ncols);
  }
  return C;
}

}  // namespace dal_npu
