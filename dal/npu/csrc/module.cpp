// Python bindings of the dal NPU reference kernels (built by dal/npu/build.py).
#include <torch/python.h>  // pybind11 and its at::Tensor casters: only this file binds
#include <torch/types.h>

#include "blocked_gemm.h"
#include "gemm_s16.h"
#include "lut16.h"
#include "qconv.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dal NPU reference: exact integer kernels";
  m.def("gemm_s16", &dal_npu::gemm_s16, "exact int16 GEMM, pair-packed B");
  m.def("sparse24_gemm_s16", &dal_npu::sparse24_gemm_s16, "exact 2:4 sparse int16 GEMM");
  m.def("im2col_s16", &dal_npu::im2col_s16, "im2col of an int16 image");
  m.def("dwconv_s16", &dal_npu::dwconv_s16, "exact depthwise conv");
  m.def("requant_float", &dal_npu::requant_float, "float-scale requantizer (ONNX QuantizeLinear)");
  m.def("requant_fixed", &dal_npu::requant_fixed, "fixed-point multiplier + shift requantizer");
  m.def("qconv", &dal_npu::qconv, "fused integer conv: codes in, codes out");
  m.def("qgemm", &dal_npu::qgemm, "fused integer gemm: codes in, codes out");
  m.def("maxpool_codes", &dal_npu::maxpool_codes, "max pool of codes + lookup table");
  m.def("maxpool_codes_nhwc", &dal_npu::maxpool_codes_nhwc, "max pool of pixel-major codes + lookup table");
  m.def("quantize_codes", &dal_npu::quantize_codes, "QuantizeLinear of float32 to 8-bit codes (one scale)");
  m.def("lut2_codes", &dal_npu::lut2_codes, "binary op of two code tensors by lookup table");
  m.def("gap_codes_mean", &dal_npu::gap_codes_mean, "per-channel means of a code table (GlobalAveragePool)");
  m.def("blocked_gemm", &dal_npu::blocked_gemm, "blocked linear: exact per-block int32 sums, float64 combine");
  m.def("lut16", &dal_npu::lut16, "float32 table lookup by 16-bit patterns");
  m.def("lut8", &dal_npu::lut8, "float32 table lookup by 8-bit codes");
  m.def("cpu_supports_isa", &dal_npu::cpu_supports_isa, "this CPU runs kernel variant isa (cpuid)");
  m.def("best_isa", &dal_npu::best_isa, "the fastest kernel variant this CPU runs");
  m.def("isa_name", [](int64_t isa) { return std::string(dal_npu::isa_name(isa)); }, "name of a kernel variant");
  m.def("isa_status", &dal_npu::isa_status, "why this CPU can or cannot run kernel variant isa");
}
