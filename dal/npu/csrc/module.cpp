// Python bindings of the dal NPU reference kernels (built by dal/npu/build.py).
#include "gemm_s16.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dal NPU reference: exact integer kernels";
  m.def("gemm_s16", &dal_npu::gemm_s16, "exact int16 GEMM, pair-packed B");
  m.def("sparse24_gemm_s16", &dal_npu::sparse24_gemm_s16, "exact 2:4 sparse int16 GEMM");
  m.def("im2col_s16", &dal_npu::im2col_s16, "im2col of an int16 image");
  m.def("dwconv_s16", &dal_npu::dwconv_s16, "exact depthwise conv");
  m.def("requant_float", &dal_npu::requant_float, "float-scale requantizer (ONNX QuantizeLinear)");
  m.def("requant_fixed", &dal_npu::requant_fixed, "fixed-point multiplier + shift requantizer");
  m.def("has_avx2_build", &dal_npu::has_avx2_build, "built with AVX2 kernels");
}
