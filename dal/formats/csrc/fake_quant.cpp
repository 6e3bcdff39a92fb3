// Fused fake quantization, one pass forward and one pass backward (dal.formats.fused).
//
// Forward, per element, with the row's scale s and code bounds lo = qmin - zp, hi = qmax - zp:
//     v   = x / s                                  (IEEE division, as ONNX QuantizeLinear)
//     int:  r = round_half_even(v);  c = clamp(r, lo, hi);     mask = lo <= r <= hi
//     fp8:  c = rne_to_fp8(clamp(v, -max, max));               mask = |v| <= max
//     out = c * s
// Backward: grad_x = grad_out * (mask ? 1 : 0)  (a multiply, like the eager path, so that
// NaN / inf gradients and signed zeros come out identical).
//
// The mask is bit-packed: row r owns ceil(row_len / 8) bytes, bit j of byte k is element 8k + j.
// clamp keeps its argument unless it is strictly outside [lo, hi] (NaN stays NaN, -0 stays -0),
// exactly like torch.clamp, so this file and the eager path agree bit for bit.
//
// Plain C ABI (called through ctypes): no torch headers, so it builds in about a second.
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

enum Mode { MODE_INT = 0, MODE_E4M3 = 1, MODE_E5M2 = 2 };

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Round t (|t| <= format max, or NaN) to the nearest FP8 value, ties to even. The FP8 grid near
// t has spacing q = 2^(max(e, emin) - mant): scaling by the exact power of two 1/q, rounding to
// an integer and scaling back is exact, so this is RNE on the FP8 grid (subnormals included).
inline float round_fp8(float t, int mant, int emin_biased) {
    int e = (int)((float_to_bits(t) >> 23) & 0xff);
    int eq = (e > emin_biased ? e : emin_biased) - mant;
    float q = bits_to_float((uint32_t)eq << 23);
    float inv_q = bits_to_float((uint32_t)(254 - eq) << 23);
    return std::nearbyint(t * inv_q) * q;
}

inline void fp8_params(int mode, int* mant, int* emin_biased) {
    if (mode == MODE_E4M3) { *mant = 3; *emin_biased = 127 - 6; }
    else { *mant = 2; *emin_biased = 127 - 14; }
}

// The float32 NaN that torch produces when it widens the FP8 NaN back (sign kept): the eager
// path goes through a real FP8 tensor, so its NaNs carry this payload.
inline uint32_t fp8_nan_bits(int mode) { return mode == MODE_E4M3 ? 0x7ff00000u : 0x7fe00000u; }

// One scalar element; returns the mask bit.
inline int fq_one(float x, float s, float lo, float hi, int mode, float* out) {
    float v = x / s;
    if (mode == MODE_INT) {
        float r = std::nearbyint(v);
        float c = r < lo ? lo : r;
        c = c > hi ? hi : c;
        *out = c * s;
        return (r >= lo) & (r <= hi);
    }
    int mant, emin;
    fp8_params(mode, &mant, &emin);
    float c = v < lo ? lo : v;
    c = c > hi ? hi : c;
    c = c != c ? bits_to_float((float_to_bits(c) & 0x80000000u) | fp8_nan_bits(mode)) : round_fp8(c, mant, emin);
    *out = c * s;
    return std::fabs(v) <= hi;
}

// Elements [begin, end) of one row (begin is a multiple of 8); mask points at the row's bytes.
void fq_span(const float* x, float* out, uint8_t* mask, int64_t begin, int64_t end,
             float s, float lo, float hi, int mode) {
    int64_t i = begin;
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(s), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int mant = 0, emin = 0;
    if (mode != MODE_INT) fp8_params(mode, &mant, &emin);
    const __m256i vemin = _mm256_set1_epi32(emin), vmant = _mm256_set1_epi32(mant);
    const __m256i v254 = _mm256_set1_epi32(254), vff = _mm256_set1_epi32(0xff);
    const __m256 vnan = _mm256_castsi256_ps(_mm256_set1_epi32((int)(mode == MODE_INT ? 0 : fp8_nan_bits(mode))));
    for (; i + 8 <= end; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vs);
        __m256 c, keep;
        if (mode == MODE_INT) {
            __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256 below = _mm256_cmp_ps(r, vlo, _CMP_LT_OQ);
            __m256 above = _mm256_cmp_ps(r, vhi, _CMP_GT_OQ);
            c = _mm256_blendv_ps(_mm256_blendv_ps(r, vlo, below), vhi, above);
            keep = _mm256_and_ps(_mm256_cmp_ps(r, vlo, _CMP_GE_OQ), _mm256_cmp_ps(r, vhi, _CMP_LE_OQ));
        } else {
            __m256 t = _mm256_blendv_ps(v, vlo, _mm256_cmp_ps(v, vlo, _CMP_LT_OQ));
            t = _mm256_blendv_ps(t, vhi, _mm256_cmp_ps(t, vhi, _CMP_GT_OQ));
            __m256i e = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(t), 23), vff);
            __m256i eq = _mm256_sub_epi32(_mm256_max_epi32(e, vemin), vmant);
            __m256 q = _mm256_castsi256_ps(_mm256_slli_epi32(eq, 23));
            __m256 inv_q = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(v254, eq), 23));
            c = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(t, inv_q),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), q);
            c = _mm256_blendv_ps(c, _mm256_or_ps(_mm256_and_ps(t, sign), vnan), _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
            keep = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), vhi, _CMP_LE_OQ);
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(c, vs));
        if (mask) mask[i >> 3] = (uint8_t)_mm256_movemask_ps(keep);
    }
#endif
    for (; i < end; i += 8) {  // scalar tail, still one mask byte per 8 elements
        uint8_t byte = 0;
        int64_t stop = i + 8 < end ? i + 8 : end;
        for (int64_t j = i; j < stop; ++j)
            byte |= (uint8_t)(fq_one(x[j], s, lo, hi, mode, out + j) << (j - i));
        if (mask) mask[i >> 3] = byte;
    }
}

void bwd_span(const float* g, const uint8_t* mask, float* gin, int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef __AVX2__
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= end; i += 8) {
        __m256i b = _mm256_and_si256(_mm256_set1_epi32(mask[i >> 3]), bits);
        __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bits));
        _mm256_storeu_ps(gin + i, _mm256_mul_ps(_mm256_loadu_ps(g + i), _mm256_and_ps(m, one)));
    }
#endif
    for (; i < end; ++i)
        gin[i] = g[i] * (float)((mask[i >> 3] >> (i & 7)) & 1);
}

constexpr int64_t kChunk = 16384;  // elements per work item (a multiple of 8: mask bytes align)

}  // namespace

extern "C" {

// x, out: rows * row_len contiguous floats. Row r uses parameter p = (r / param_div) % param_mod
// of scale, lo, hi. mask: rows * ceil(row_len / 8) bytes, or null when no gradient is needed.
void dal_fq_forward(const float* x, float* out, uint8_t* mask, int64_t rows, int64_t row_len,
                    int64_t param_div, int64_t param_mod, const float* scale, const float* lo,
                    const float* hi, int mode, int nthreads) {
    const int64_t chunks = (row_len + kChunk - 1) / kChunk;
    const int64_t mask_row = (row_len + 7) / 8;
    const int64_t items = rows * chunks;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && items > 1)
    for (int64_t it = 0; it < items; ++it) {
        int64_t r = it / chunks, k = it % chunks;
        int64_t p = (r / param_div) % param_mod;
        int64_t begin = k * kChunk, end = begin + kChunk < row_len ? begin + kChunk : row_len;
        fq_span(x + r * row_len, out + r * row_len, mask ? mask + r * mask_row : nullptr,
                begin, end, scale[p], lo[p], hi[p], mode);
    }
}

void dal_fq_backward(const float* grad, const uint8_t* mask, float* grad_in, int64_t rows,
                     int64_t row_len, int nthreads) {
    const int64_t chunks = (row_len + kChunk - 1) / kChunk;
    const int64_t mask_row = (row_len + 7) / 8;
    const int64_t items = rows * chunks;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && items > 1)
    for (int64_t it = 0; it < items; ++it) {
        int64_t r = it / chunks, k = it % chunks;
        int64_t begin = k * kChunk, end = begin + kChunk < row_len ? begin + kChunk : row_len;
        bwd_span(grad + r * row_len, mask + r * mask_row, grad_in + r * row_len, begin, end);
    }
}

int dal_fq_abi_version() { return 1; }

}  // extern "C"
