// The blocked integer linear of export/SPEC.md §5a in one pass (dal.kernels.blocked_sums, used by
// dal.convert's BlockedWeights for a few rows): exact int32 block sums, combined in float64 in
// ascending block order, then scaled by the input scale and rounded once to float32.
//
// For each row m, with x[m, k] the input codes minus zero point (integer-valued float32, |x| <= 255),
// w[b, k, n] the weight codes minus zero point of block b (int8), s[b, n] their float32 scales:
//     acc_b[n] = sum_{k < B} x[m, b B + k] * w[b, k, n]          int32, exact (|acc_b| < 2^31)
//     t[n]     = ((acc_0 s_0 + acc_1 s_1) + acc_2 s_2) + ...      float64, b ascending; each product
//                                                                 and each addition rounded once (no FMA)
//     v[m, n]  = float32(t[n] * s_x)                              float64 product, one rounding
// which is blocked_linear.py's reference loop, bit for bit, for every input (the int32 block sums are
// the exact integers the reference's float64 block sums hold).
//
// dal_blocked_linear_q takes the float32 input itself and makes the codes first, as ONNX QuantizeLinear
// minus the zero point (IntegerLayer._input_codes): x = clamp(round_half_even(in / s_in), lo, hi) with
// an IEEE float32 division, NaN refused.
//
// Weight layout (dal.kernels.blocked_sums.pack): [nb, ceil(B / 2), N, 2] int8, the codes of rows
// k = 2j and 2j + 1 of block b side by side (a zero row pads an odd B), so that one AVX2 vpmaddwd
// multiplies 8 columns by two input codes and adds the pairs (|x w| + |x w| <= 2 * 255 * 128 < 2^31).
//
// Plain C ABI (ctypes), no torch headers, built by dal.formats.native.compile_library.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "int_code.h"

namespace {

// One block's input codes of row m into xp as (x_2j, x_2j+1) int16 pairs. quant 0: the input holds
// the codes; returns 1 + the flat index of the first that is not an integer in [-255, 255] (NaN
// fails both compares, a non-integer the round trip through int32), else 0. quant 1: the codes are
// clamp(rint(in / s_in), lo, hi) (float32 division, half-even: the default rounding mode); returns
// 1 + the flat index of the first NaN, else 0.
inline int64_t block_codes(const float* xb, int64_t B, int64_t flat0, int quant, float s_in, float lo, float hi,
                           int32_t* xp) {
    const int64_t pairs = (B + 1) / 2;
    int32_t c[2];
    for (int64_t j = 0; j < pairs; ++j) {
        for (int h = 0; h < 2; ++h) {
            const int64_t k = 2 * j + h;
            if (k >= B) { c[h] = 0; continue; }
            float v = xb[k];
            if (quant) {
                v = int_code_round(v, s_in);
                if (v != v) return 1 + flat0 + k;
                v = int_code_clamp(v, lo, hi);
            } else if (!(v >= -255.0f && v <= 255.0f) || static_cast<float>(static_cast<int32_t>(v)) != v) {
                return 1 + flat0 + k;
            }
            c[h] = static_cast<int32_t>(v);
        }
        xp[j] = static_cast<int32_t>((static_cast<uint32_t>(static_cast<uint16_t>(c[1])) << 16)
                                     | static_cast<uint16_t>(c[0]));
    }
    return 0;
}

int64_t blocked(const float* x, int64_t M, const int8_t* w, const float* s, int64_t nb, int64_t B, int64_t N,
                double s_x, float* out, int quant, float s_in, float lo, float hi) {
    const int64_t K = nb * B, pairs = (B + 1) / 2;
    std::vector<int32_t> acc(N);
    std::vector<double> t(N);
    std::vector<int32_t> xp(pairs);
    for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t bad = block_codes(xm + b * B, B, m * K + b * B, quant, s_in, lo, hi, xp.data());
            if (bad) return bad;
            std::memset(acc.data(), 0, sizeof(int32_t) * N);
            const int8_t* wb = w + b * pairs * N * 2;
            for (int64_t j = 0; j < pairs; ++j) {
                if (xp[j] == 0) continue;  // both codes 0: adds nothing
                const int8_t* wj = wb + j * N * 2;
                int64_t n = 0;
#ifdef __AVX2__
                const __m256i xv = _mm256_set1_epi32(xp[j]);
                for (; n + 8 <= N; n += 8) {
                    const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 2 * n)));
                    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc.data() + n));
                    a = _mm256_add_epi32(a, _mm256_madd_epi16(w16, xv));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc.data() + n), a);
                }
#endif
                const int32_t x0 = static_cast<int16_t>(xp[j] & 0xffff), x1 = static_cast<int16_t>(xp[j] >> 16);
                for (; n < N; ++n) acc[n] += x0 * wj[2 * n] + x1 * wj[2 * n + 1];
            }
            const float* sb = s + b * N;
            if (b == 0) {
                for (int64_t n = 0; n < N; ++n) t[n] = static_cast<double>(acc[n]) * static_cast<double>(sb[n]);
            } else {
                for (int64_t n = 0; n < N; ++n) t[n] = t[n] + static_cast<double>(acc[n]) * static_cast<double>(sb[n]);
            }
        }
        float* om = out + m * N;
        for (int64_t n = 0; n < N; ++n) om[n] = static_cast<float>(t[n] * s_x);
    }
    return 0;
}

}  // namespace

extern "C" {

int dal_blocked_abi_version() { return 2; }

// x [M, nb * B] float32 (integer values), w packed as above, s [nb, N] float32, out [M, N] float32.
// Returns 0, or 1 + the flat index of the first x that is not an integer in [-255, 255] (out is
// then incomplete: the caller raises).
int64_t dal_blocked_linear(const float* x, int64_t M, const int8_t* w, const float* s, int64_t nb, int64_t B,
                           int64_t N, double s_x, float* out) {
    return blocked(x, M, w, s, nb, B, N, s_x, out, 0, 1.0f, 0.0f, 0.0f);
}

// The same from the float32 input `in` [M, nb * B] (codes made as in the header; lo, hi integers with
// -255 <= lo <= hi <= 255, s_in > 0: the caller's). Returns 0, or 1 + the flat index of the first NaN.
int64_t dal_blocked_linear_q(const float* in, int64_t M, const int8_t* w, const float* s, int64_t nb, int64_t B,
                             int64_t N, float s_in, float lo, float hi, double s_x, float* out) {
    return blocked(in, M, w, s, nb, B, N, s_x, out, 1, s_in, lo, hi);
}

}  // extern "C"
