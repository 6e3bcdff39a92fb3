// The kernel sources as one translation unit: torch's headers are parsed once, not nine
// times (dal/npu/build.py, "Build time"). Each file stays its own concept; none defines a
// macro or a name with internal linkage that another one defines.
#include "isa.cpp"
#include "gemm_s16.cpp"
#include "conv_s16.cpp"
#include "requant.cpp"
#include "qconv.cpp"
#include "pool_codes.cpp"
#include "quantize.cpp"
#include "blocked_gemm.cpp"
#include "lut16.cpp"
