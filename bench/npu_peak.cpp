// The machine's int8 peak for bench/npu.py: a register-only loop of exact u8 x s8 -> int32
// dot-product instructions, with enough independent accumulators to hide their latency.
// Each vpdpbusd on zmm does 64 multiply-adds (128 ops), on ymm 32 (64 ops). Built by
// bench/npu.py through dal.npu.build.build_extension; variants carry target attributes and
// run only where cpuid has them.
#include <immintrin.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // GOP/s (2 ops per multiply-add) of one thread; call only where cpuid has the instructions
  m.def("zmm_vnni", [](int64_t iters) { return gops(loop_zmm, iters, 12 * 64 * 2.0); });
  m.def("ymm_vnni", [](int64_t iters) { return gops(loop_ymm, iters, 12 * 32 * 2.0); });
  m.def("ymm_madd", [](int64_t iters) { return gops(loop_madd, iters, 6 * 16 * 2.0); });
}
