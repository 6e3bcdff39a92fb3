// A 65,536-entry float32 table indexed by 16-bit patterns (dal/npu/half_tables.py: an element-wise
// run of an FP16 island looked up by its float16 input's bits): out[i] = table[bits(h[i])].
// A gather from a 256 KB table: one load per element, no arithmetic, so the result is the
// table's entry itself (bit for bit, NaN payloads included). lut8: the same with a 256-entry table
// indexed by a code's byte (dal/npu/quant_step.py DequantStep, code_moves.py CodeMoves).
#include <torch/types.h>  // ATen and the torch:: names; pybind11 only in module.cpp

#include <cstdint>
#include <cstring>

#include "lut16.h"

namespace dal_npu {

torch::Tensor lut16(const torch::Tensor& H, const torch::Tensor& table) {
  TORCH_CHECK(H.is_contiguous() && (H.scalar_type() == torch::kFloat16 || H.scalar_type() == torch::kInt16),
              "lut16: H must be contiguous float16 (or int16) patterns");
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == torch::kFloat32 && table.dim() == 1 &&
                  table.numel() == 65536,
              "lut16: table must be contiguous float32 [65536]");
  auto out = torch::empty(H.sizes(), torch::kFloat32);
  const int64_t n = H.numel();
  const uint16_t* h = reinterpret_cast<const uint16_t*>(H.data_ptr());
  const float* t = table.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) o[i] = t[h[i]];
  return out;
}

torch::Tensor lut8(const torch::Tensor& C, const torch::Tensor& table) {
  TORCH_CHECK(C.is_contiguous() && (C.scalar_type() == torch::kUInt8 || C.scalar_type() == torch::kInt8),
              "lut8: C must be contiguous uint8 (or int8) codes");
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == torch::kFloat32 && table.dim() == 1 &&
                  table.numel() == 256,
              "lut8: table must be contiguous float32 [256]");
  auto out = torch::empty(C.sizes(), torch::kFloat32);
  const int64_t n = C.numel();
  const uint8_t* c = reinterpret_cast<const uint8_t*>(C.data_ptr());
  const float* t = table.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) o[i] = t[c[i]];
  return out;
}

}  // namespace dal_npu
