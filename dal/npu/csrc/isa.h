// Kernel variants of the dal NPU reference and the run-time choice between them.
//
// Every variant is compiled into the one library with per-function target attributes (the
// library's own flags stay at the x86-64 baseline), and the CPU running the code decides which
// one executes: cpuid through __builtin_cpu_supports, which also checks that the OS saves the
// wider registers. So a library built on one machine and loaded on another never executes an
// instruction the second lacks. All variants compute the same exact int32 sums.
//   0 portable     plain C++ (any CPU)
//   1 avx2         vpmaddwd on int16 pairs (AVX2 + FMA)
//   2 avx_vnni     vpdpbusd on ymm, VEX encoded (AVX-VNNI)
//   3 avx512_vnni  vpdpbusd on zmm (AVX512F/BW/VL + AVX512-VNNI)
//   4 amx_int8     tdpbusd on AMX tiles (AMX-TILE + AMX-INT8, plus everything avx512_vnni
//                  needs: its kernels serve the remainders). cpuid alone is not enough here:
//                  XCR0 must hold the tile state (the OS saves the tiles) and on Linux the
//                  process must obtain the tile-data permission (arch_prctl
//                  ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); isa_status() says which failed.
#pragma once
#include <cstdint>
#include <string>

#define DAL_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define DAL_TARGET_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#define DAL_TARGET_AVX512VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
#define DAL_TARGET_AMX \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

namespace dal_npu {

enum Isa : int { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAmxInt8 = 4, kIsaCount = 5 };

bool cpu_supports_isa(int64_t isa);  // this CPU (and OS) can run variant isa
int64_t best_isa();                   // the fastest variant this CPU supports
const char* isa_name(int64_t isa);
// why variant isa can or cannot run here (the failing check by name), for dal.npu.info()
std::string isa_status(int64_t isa);
// requested < 0: best_isa(); otherwise requested itself, refused (TORCH_CHECK) when the CPU
// lacks it -- the check that makes an illegal instruction impossible.
int isa_resolve(int64_t requested);
inline bool isa_has_avx2(int isa) { return isa >= kAvx2; }
inline bool isa_has_avx512(int isa) { return isa >= kAvx512Vnni; }  // amx_int8 includes it

}  // namespace dal_npu
