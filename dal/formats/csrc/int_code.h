// The integer step of ONNX QuantizeLinear, less the zero point, in one place for the C++ kernels of
// dal.formats (the fused fake quantization, fake_quant.cpp) and of the integer model (the blocked
// linear's input codes, blocked_sums.cpp); dal.formats.quantize is the reference both are tested
// against:
//     r = round_half_even(x / s)     IEEE float32 division, the default rounding mode
//     c = clamp(r, lo, hi)           r kept unless strictly outside [lo, hi]: NaN stays NaN
#pragma once

#include <cmath>

inline float int_code_round(float x, float s) { return std::nearbyint(x / s); }

inline float int_code_clamp(float r, float lo, float hi) {
    const float c = r < lo ? lo : r;
    return c > hi ? hi : c;
}
