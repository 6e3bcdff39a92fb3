// A float32 table indexed by 16-bit patterns (csrc/lut16.cpp).
#pragma once
#include <torch/types.h>  // ATen and the torch:: names; pybind11 only in module.cpp

namespace dal_npu {

// out = table[bits of H]: H contiguous float16 (or int16) patterns of any shape, table float32
// [65536]; float32 of H's shape.
torch::Tensor lut16(const torch::Tensor& H, const torch::Tensor& table);

// out = table[byte of C]: C contiguous uint8 (or int8) codes of any shape, table float32 [256];
// float32 of C's shape.
torch::Tensor lut8(const torch::Tensor& C, const torch::Tensor& table);

}  // namespace dal_npu
