// Run-time CPU dispatch: which kernel variants this CPU can execute (see isa.h).
#include "isa.h"

#include <cpuid.h>
#include <torch/types.h>  // ATen and the torch:: names; pybind11 only in module.cpp

#include <cerrno>
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dal_npu {

namespace {

struct Probe {
  bool ok = false;
  std::string why;
};

// AMX-INT8 usable by this process: cpuid bits, the OS's tile state in XCR0, then (Linux) the
// tile-data permission, requested once per process (the kernel grants it process-wide). The
// first failing check is the reason; DAL_NPU_DISABLE_AMX=1 turns the variant off (to compare).
Probe probe_amx() {
  Probe p;
  const char* off = std::getenv("DAL_NPU_DISABLE_AMX");
  if (off && *off && std::strcmp(off, "0") != 0) {
    p.why = "disabled by DAL_NPU_DISABLE_AMX";
    return p;
  }
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    p.why = "cpuid has no leaf 7";
    return p;
  }
  if (!(d & (1u << 24)) || !(d & (1u << 25))) {
    p.why = std::string("cpuid lacks ") + (!(d & (1u << 24)) ? "AMX-TILE" : "AMX-INT8");
    return p;
  }
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) {
    p.why = "the OS has not enabled XSAVE (cpuid OSXSAVE clear)";
    return p;
  }
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) {
    p.why = "XCR0 lacks the tile state (XTILECFG/XTILEDATA): the OS does not save AMX registers";
    return p;
  }
#if defined(__linux__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
    p.why = std::string("Linux refused the tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
            std::strerror(errno) + ")";
    return p;
  }
  p.ok = true;
  p.why = "cpuid AMX-TILE + AMX-INT8, XCR0 tile state, arch_prctl tile-data permission granted";
#else
  p.why = "AMX needs the OS's tile-data permission, requested here only on Linux";
#endif
  return p;
}

const Probe& amx_probe() {
  static const Probe p = probe_amx();  // thread-safe, once per process
  return p;
}

}  // namespace

bool cpu_supports_isa(int64_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  switch (isa) {
    case kPortable: return true;
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni: return avx512;
    case kAmxInt8: return avx512 && amx_probe().ok;
    default: return false;
  }
}

std::string isa_status(int64_t isa) {
  if (isa == kAmxInt8) {
    if (!cpu_supports_isa(kAvx512Vnni)) return "needs avx512_vnni as well (its kernels serve the remainders)";
    return amx_probe().why;
  }
  if (isa < 0 || isa >= kIsaCount) return "no such variant";
  return cpu_supports_isa(isa) ? "cpuid has the instructions" : "cpuid lacks the instructions";
}

int64_t best_isa() {
  for (int isa = kIsaCount - 1; isa > 0; --isa)
    if (cpu_supports_isa(isa)) return isa;
  return kPortable;
}

const char* isa_name(int64_t isa) {
  static const char* names[kIsaCount] = {"portable", "avx2", "avx_vnni", "avx512_vnni", "amx_int8"};
  return isa >= 0 && isa < kIsaCount ? names[isa] : "unknown";
}

int isa_resolve(int64_t requested) {
  if (requested < 0) return static_cast<int>(best_isa());
  TORCH_CHECK(requested < kIsaCount, "kernel variant ", requested, " does not exist (0..", kIsaCount - 1, ")");
  TORCH_CHECK(cpu_supports_isa(requested), "this CPU cannot run the ", isa_name(requested), " kernels (",
              isa_status(requested), ")");
  return static_cast<int>(requested);
}

}  // namespace dal_npu
