// The machine's int8 peak for bench/npu.py: a register-only loop of exact u8 x s8 -> int32
// dot-product instructions, with enough independent accumulators to hide their latency.
// Each vpdpbusd on zmm does 64 multiply-adds (128 ops), on ymm 32 (64 ops); each AMX tdpbusd
// 16 x 16 x 64 = 16384 (32768 ops), four independent accumulator tiles. Built by
// bench/npu.py through dal.npu.build.build_extension; variants carry target attributes and
// run only where cpuid has them.
#include <immintrin.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// dal.npu's own AMX kernel and requantizer, the code the library runs (bench/npu.py passes
// these headers as build dependencies, so that an edit rebuilds this module too)
#include "../dal/npu/csrc/qconv_amx.h"
#include "../dal/npu/csrc/qconv_requant.h"

namespace {

template <typename F>
double gops(F&& body, int64_t iters, double ops_per_iter) {
  body(iters / 10);  // warm up (frequency, caches)
  const auto t0 = std::chrono::steady_clock::now();
  const int32_t sink = body(iters);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return (sink == 12345 ? 1.0 : 1.0) * ops_per_iter * double(iters) / s / 1e9;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) int32_t loop_zmm(int64_t n) {
  __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x05060708);
  __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0,
          c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  for (int64_t i = 0; i < n; ++i) {
    c0 = _mm512_dpbusd_epi32(c0, a, b); c1 = _mm512_dpbusd_epi32(c1, a, b);
    c2 = _mm512_dpbusd_epi32(c2, a, b); c3 = _mm512_dpbusd_epi32(c3, a, b);
    c4 = _mm512_dpbusd_epi32(c4, a, b); c5 = _mm512_dpbusd_epi32(c5, a, b);
    c6 = _mm512_dpbusd_epi32(c6, a, b); c7 = _mm512_dpbusd_epi32(c7, a, b);
    c8 = _mm512_dpbusd_epi32(c8, a, b); c9 = _mm512_dpbusd_epi32(c9, a, b);
    c10 = _mm512_dpbusd_epi32(c10, a, b); c11 = _mm512_dpbusd_epi32(c11, a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));  // keep the operands opaque to the optimizer
  }
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                               _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
  return _mm512_reduce_add_epi32(s);
}

__attribute__((target("avx2,avxvnni"))) int32_t loop_ymm(int64_t n) {
  __m256i a = _mm256_set1_epi32(0x01020304), b = _mm256_set1_epi32(0x05060708);
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0,
          c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  for (int64_t i = 0; i < n; ++i) {
    c0 = _mm256_dpbusd_avx_epi32(c0, a, b); c1 = _mm256_dpbusd_avx_epi32(c1, a, b);
    c2 = _mm256_dpbusd_avx_epi32(c2, a, b); c3 = _mm256_dpbusd_avx_epi32(c3, a, b);
    c4 = _mm256_dpbusd_avx_epi32(c4, a, b); c5 = _mm256_dpbusd_avx_epi32(c5, a, b);
    c6 = _mm256_dpbusd_avx_epi32(c6, a, b); c7 = _mm256_dpbusd_avx_epi32(c7, a, b);
    c8 = _mm256_dpbusd_avx_epi32(c8, a, b); c9 = _mm256_dpbusd_avx_epi32(c9, a, b);
    c10 = _mm256_dpbusd_avx_epi32(c10, a, b); c11 = _mm256_dpbusd_avx_epi32(c11, a, b);
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                               _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
  s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(c8, c9), _mm256_add_epi32(c10, c11)));
  return _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}

// int16 pairs (vpmaddwd + vpaddd): the exact peak of CPUs without VNNI (16 ops per lane pair)
__attribute__((target("avx2"))) int32_t loop_madd(int64_t n) {
  __m256i a = _mm256_set1_epi32(0x00010002), b = _mm256_set1_epi32(0x00030004);
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  for (int64_t i = 0; i < n; ++i) {
    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(a, b)); c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(a, b));
    c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(a, b)); c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(a, b));
    c4 = _mm256_add_epi32(c4, _mm256_madd_epi16(a, b)); c5 = _mm256_add_epi32(c5, _mm256_madd_epi16(a, b));
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(_mm256_add_epi32(c2, c3), _mm256_add_epi32(c4, c5)));
  return _mm256_extract_epi32(s, 0);
}

// AMX: C tiles 0..3 += A tiles 4/5 x B tiles 6/7 (2 x 2, as dal.npu's kernel), operands loaded
// once. Needs the tile-data permission (Linux arch_prctl; dal.npu requests the same one).
struct alignas(64) TileCfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-int8"))) int32_t loop_amx(int64_t n) {
  TileCfg cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  alignas(64) static uint8_t buf[1024];
  alignas(64) static int32_t out[256];
  for (int i = 0; i < 1024; ++i) buf[i] = uint8_t(i * 7);
  _tile_loadconfig(&cfg);
  _tile_loadd(4, buf, 64);
  _tile_loadd(5, buf, 64);
  _tile_loadd(6, buf, 64);
  _tile_loadd(7, buf, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < n; ++i) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}

// The same 2 x 2 step with its four operand tiles loaded every step (tileloadd, 1 KB each) from
// a buffer of random bytes cycled over: the bound of any GEMM built on this blocking, by where
// its operands come from (a buffer of 32 KB stays in L1, 512 KB in L2). Random data: untouched
// pages are all one physical zero page, which every load would find in L1. Split: the two A
// tiles from a second buffer of a_kib (16 KB: L1, as dal.npu's K blocks keep the rows), the
// two B tiles from the first (the weights, streaming from L2).
static uint8_t* g_buf = nullptr;
static uint8_t* g_abuf = nullptr;
static int64_t g_steps = 0, g_asteps = 0;

template <bool Split>
__attribute__((target("amx-tile,amx-int8"))) int32_t loop_amx_loads(int64_t n) {
  TileCfg cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  alignas(64) static int32_t out[256];
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t tile = 1024, quarter = g_steps * tile;
  for (int64_t i = 0, k = 0, ka = 0; i < n; ++i, k = k + 1 == g_steps ? 0 : k + 1) {
    const uint8_t* a = Split ? g_abuf + ka * 2 * tile : g_buf + k * tile;
    const uint8_t* a1 = Split ? a + tile : a + quarter;
    const uint8_t* b0 = Split ? g_buf + k * 2 * tile : a + 2 * quarter;
    const uint8_t* b1 = Split ? b0 + tile : a + 3 * quarter;
    if (Split) ka = ka + 1 == g_asteps ? 0 : ka + 1;
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b0, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_loadd(7, b1, 64);
    _tile_dpbusd(1, 4, 7);
    _tile_loadd(5, a1, 64);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}

// a_kib 0: all four tiles cycled over kib; else A over a_kib, B over kib
double amx_loads_gops(int64_t iters, int64_t kib, int64_t a_kib) {
#if defined(__linux__)
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return NAN;
  const bool split = a_kib > 0;
  g_steps = std::max<int64_t>(1, kib / (split ? 2 : 4));
  g_asteps = std::max<int64_t>(1, a_kib / 2);
  auto fill = [](std::vector<uint8_t>& buf, uint32_t x) {
    for (auto& b : buf) b = static_cast<uint8_t>((x = x * 1103515245u + 12345u) >> 24);
    return buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  };
  std::vector<uint8_t> buf(static_cast<size_t>(g_steps * 4096 + 64)), abuf(static_cast<size_t>(g_asteps * 2048 + 64));
  g_buf = fill(buf, 12345);
  g_abuf = split ? fill(abuf, 777) : nullptr;
  const double r = gops(split ? loop_amx_loads<true> : loop_amx_loads<false>, iters, 4 * 16 * 16 * 64 * 2.0);
  g_buf = g_abuf = nullptr;
  return r;
#else
  return NAN;
#endif
}

double amx_gops(int64_t iters) {
#if defined(__linux__)
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return NAN;
  return gops(loop_amx, iters, 4 * 16 * 16 * 64 * 2.0);
#else
  return NAN;
#endif
}

// Where the fused exact GEMM's time goes (bench/npu.py): dal.npu's AMX kernel (qconv_amx.h
// gemm, as run_core calls it: one call per task of up to 192 rows, under one TileScope) on
// random u8 rows read in place (m x k, line aligned) against random s8 panels, and its
// one-pass requantizer (qconv_requant.h) -- (a) tiles alone, (b) the requantizer alone over
// the m x n accumulators, (c) both as the fused call interleaves them (each 32-row group
// requantized right after its tiles). Medians of reps calls, microseconds. Needs k % 64 == 0,
// n % 16 == 0 and the AMX tile-data permission (NaNs otherwise).
pybind11::tuple amx_gemm_phases(int64_t m, int64_t k, int64_t n, int64_t reps) {
  const double nan = NAN;
  if (m < 1 || k < 64 || k % 64 || n < 16 || n % 16 || reps < 1) throw std::invalid_argument("amx_gemm_phases: bad shape");
#if defined(__linux__)
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
    return pybind11::make_tuple(nan, nan, nan);
  using namespace dal_npu;
  const int64_t K4 = k / 4, npan = n / 16, panel = K4 * 64, task = 192;
  amx::Aligned<uint8_t> abuf;
  amx::Aligned<int8_t> bbuf;
  amx::Aligned<int32_t> cbuf;
  uint8_t* a = abuf.get(static_cast<size_t>(m * k));
  int8_t* b = bbuf.get(static_cast<size_t>(npan * panel));
  int32_t* c = cbuf.get(static_cast<size_t>(m * n));
  uint32_t x = 12345;
  for (int64_t i = 0; i < m * k; ++i) a[i] = static_cast<uint8_t>((x = x * 1103515245u + 12345u) >> 24);
  for (int64_t i = 0; i < npan * panel; ++i) b[i] = static_cast<int8_t>((x = x * 1103515245u + 12345u) >> 24);
  std::vector<double> mult(static_cast<size_t>(n), 1e-4);
  std::vector<uint8_t> out(static_cast<size_t>(m * n));
  rq::Requant q;
  q.O = q.Op = n;
  q.mult = mult.data();
  q.ys = 0.05f, q.zy = 128, q.lo = 0, q.hi = 255;
  auto tiles = [&](bool requant) {
    for (int64_t t0 = 0; t0 < m; t0 += task) {
      const int64_t tn = std::min(task, m - t0);
      int32_t* ct = c + t0 * n;
      uint8_t* ot = out.data() + t0 * n;
      const amx::TileScope scope(true);
      amx::gemm(a + t0 * k, tn, k, b, panel, npan, K4, nullptr, ct, n, [&](int64_t r0, int64_t r1) {
        if (requant) rq::requant_block_avx512<uint8_t>(q, ct + r0 * n, r1 - r0, ot + r0 * n, n);
      });
    }
  };
  auto median_us = [&](auto&& body) {
    body();
    std::vector<double> ts;
    for (int64_t r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      body();
      ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  const double t_tiles = median_us([&] { tiles(false); });
  const double t_rq = median_us([&] { rq::requant_block_avx512<uint8_t>(q, c, m, out.data(), n); });
  const double t_both = median_us([&] { tiles(true); });
  return pybind11::make_tuple(t_tiles, t_rq, t_both);
#else
  return pybind11::make_tuple(nan, nan, nan);
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // GOP/s (2 ops per multiply-add) of one thread; call only where cpuid has the instructions
  m.def("zmm_vnni", [](int64_t iters) { return gops(loop_zmm, iters, 12 * 64 * 2.0); });
  m.def("ymm_vnni", [](int64_t iters) { return gops(loop_ymm, iters, 12 * 32 * 2.0); });
  m.def("ymm_madd", [](int64_t iters) { return gops(loop_madd, iters, 6 * 16 * 2.0); });
  m.def("amx_tdpbusd", &amx_gops);  // NaN where the OS refuses the tile-data permission
  m.def("amx_tdpbusd_loads", &amx_loads_gops, pybind11::arg("iters"), pybind11::arg("kib"),
        pybind11::arg("a_kib") = 0);  // KiB of operands cycled over (a_kib > 0: A tiles apart)
  m.def("amx_gemm_phases", &amx_gemm_phases);    // (m, k, n, reps) -> us: tiles, requantizer, both
}
