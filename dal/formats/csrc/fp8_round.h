// FP8 rounding shared by the fake-quant kernel (fake_quant.cpp) and the LSQ backward (lsq.cpp):
// one copy of the E4M3 / E5M2 grid arithmetic in C++ (dal.formats' FP8 formats: ml_dtypes'
// float8_e4m3fn / float8_e5m2 grids, checked against ml_dtypes in tests/kernels).
// Included once per translation unit; dal.formats.native's cache key covers this header.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum Mode { MODE_INT = 0, MODE_E4M3 = 1, MODE_E5M2 = 2 };

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Round t (|t| <= format max, or NaN, returned as it is) to the nearest FP8 value, ties to even.
// The FP8 grid near t has spacing q = 2^(max(e, emin) - mant): scaling by the exact power of two
// 1/q, rounding to an integer and scaling back is exact, so this is RNE on the FP8 grid
// (subnormals included).
inline float round_fp8(float t, int mant, int emin_biased) {
    if (t != t) return t;
    int e = (int)((float_to_bits(t) >> 23) & 0xff);
    int eq = (e > emin_biased ? e : emin_biased) - mant;
    float q = bits_to_float((uint32_t)eq << 23);
    float inv_q = bits_to_float((uint32_t)(254 - eq) << 23);
    return std::nearbyint(t * inv_q) * q;
}

// The mantissa bits and the biased exponent of the smallest normal of the FP8 format of ``mode``.
inline void fp8_params(int mode, int* mant, int* emin_biased) {
    if (mode == MODE_E4M3) { *mant = 3; *emin_biased = 127 - 6; }
    else { *mant = 2; *emin_biased = 127 - 14; }
}

}  // namespace
