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

// The loops are inline assembly, not intrinsics: GCC merges identical intrinsic accumulators
// (same start value, same operands) into ONE register, so an intrinsics loop of 12
// "independent" vpdpbusd ran one dependent vpdpbusd per iteration (checked with objdump: a
// single vpdpbusd in the loop) and reported 12 x its ops per latency, ~1.2x the true peak
// (5-cycle latency against 2 per cycle). Here every instruction is in the loop as written.
#define DAL_DPZ(i) "vpdpbusd %%zmm1, %%zmm0, %%zmm" #i "\n\t"
#define DAL_DPY(i) "%{vex%} vpdpbusd %%ymm1, %%ymm0, %%ymm" #i "\n\t"

// 24 accumulators (zmm8..31): 2 vpdpbusd a cycle need 2 x latency in flight
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) int32_t loop_zmm(int64_t n) {
  if (n < 1) return 0;
  asm volatile(
      "vpternlogd $0xff, %%zmm0, %%zmm0, %%zmm0\n\t"
      "vpabsb %%zmm0, %%zmm1\n\t"
      "1:\n\t" DAL_DPZ(8) DAL_DPZ(9) DAL_DPZ(10) DAL_DPZ(11) DAL_DPZ(12) DAL_DPZ(13) DAL_DPZ(14) DAL_DPZ(15)
      DAL_DPZ(16) DAL_DPZ(17) DAL_DPZ(18) DAL_DPZ(19) DAL_DPZ(20) DAL_DPZ(21) DAL_DPZ(22) DAL_DPZ(23)
      DAL_DPZ(24) DAL_DPZ(25) DAL_DPZ(26) DAL_DPZ(27) DAL_DPZ(28) DAL_DPZ(29) DAL_DPZ(30) DAL_DPZ(31)
      "dec %0\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      : "+r"(n)
      :
      : "xmm0", "xmm1", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16",
        "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27",
        "xmm28", "xmm29", "xmm30", "xmm31", "cc");
  return static_cast<int32_t>(n);
}

// 12 accumulators (ymm2..13; the VEX form reaches ymm0..15 only)
__attribute__((target("avx2,avxvnni"))) int32_t loop_ymm(int64_t n) {
  if (n < 1) return 0;
  asm volatile(
      "vpcmpeqd %%ymm0, %%ymm0, %%ymm0\n\t"
      "vpabsb %%ymm0, %%ymm1\n\t"
      "1:\n\t" DAL_DPY(2) DAL_DPY(3) DAL_DPY(4) DAL_DPY(5) DAL_DPY(6) DAL_DPY(7) DAL_DPY(8) DAL_DPY(9)
      DAL_DPY(10) DAL_DPY(11) DAL_DPY(12) DAL_DPY(13)
      "dec %0\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      : "+r"(n)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return static_cast<int32_t>(n);
}

// int16 pairs (vpmaddwd + vpaddd): the exact peak of CPUs without VNNI (16 ops per lane pair);
// 6 products (ymm2..7) added into 6 accumulators (ymm8..13) per iteration
#define DAL_MADD(t, c) "vpmaddwd %%ymm1, %%ymm0, %%ymm" #t "\n\tvpaddd %%ymm" #t ", %%ymm" #c ", %%ymm" #c "\n\t"
__attribute__((target("avx2"))) int32_t loop_madd(int64_t n) {
  if (n < 1) return 0;
  asm volatile(
      "vpcmpeqd %%ymm0, %%ymm0, %%ymm0\n\t"
      "vpabsw %%ymm0, %%ymm1\n\t"
      "1:\n\t" DAL_MADD(2, 8) DAL_MADD(3, 9) DAL_MADD(4, 10) DAL_MADD(5, 11) DAL_MADD(6, 12) DAL_MADD(7, 13)
      "dec %0\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      : "+r"(n)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return static_cast<int32_t>(n);
}
#undef DAL_DPZ
#undef DAL_DPY
#undef DAL_MADD

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
  m.def("zmm_vnni", [](int64_t iters) { return gops(loop_zmm, iters, 24 * 64 * 2.0); });
  m.def("ymm_vnni", [](int64_t iters) { return gops(loop_ymm, iters, 12 * 32 * 2.0); });
  m.def("ymm_madd", [](int64_t iters) { return gops(loop_madd, iters, 6 * 16 * 2.0); });
  m.def("amx_tdpbusd", &amx_gops);  // NaN where the OS refuses the tile-data permission
  m.def("amx_tdpbusd_loads", &amx_loads_gops, pybind11::arg("iters"), pybind11::arg("kib"),
        pybind11::arg("a_kib") = 0);  // KiB of operands cycled over (a_kib > 0: A tiles apart)
  m.def("amx_gemm_phases", &amx_gemm_phases);    // (m, k, n, reps) -> us: tiles, requantizer, both
}
