// Run-time CPU dispatch: which kernel variants this CPU can execute (see isa.h).
#include "isa.h"

#include <torch/extension.h>

namespace dal_npu {

bool cpu_supports_isa(int64_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case kPortable: return true;
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

int64_t best_isa() {
  for (int isa = kIsaCount - 1; isa > 0; --isa)
    if (cpu_supports_isa(isa)) return isa;
  return kPortable;
}

const char* isa_name(int64_t isa) {
  static const char* names[kIsaCount] = {"portable", "avx2", "avx_vnni", "avx512_vnni"};
  return isa >= 0 && isa < kIsaCount ? names[isa] : "unknown";
}

int isa_resolve(int64_t requested) {
  if (requested < 0) return static_cast<int>(best_isa());
  TORCH_CHECK(requested < kIsaCount, "kernel variant ", requested, " does not exist (0..", kIsaCount - 1, ")");
  TORCH_CHECK(cpu_supports_isa(requested), "this CPU cannot run the ", isa_name(requested),
              " kernels (cpuid lacks the instructions)");
  return static_cast<int>(requested);
}

}  // namespace dal_npu
