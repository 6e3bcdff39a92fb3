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
#if defined(__AVX2__) || (defined(__GNUC__) && defined(__x86_64__))
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

#if defined(__GNUC__) && defined(__x86_64__)
#define DAL_VNNI 1
// The same v by AVX-512 VNNI (vpdpbusd: four u8 x s8 products summed into each int32 lane), for the
// quantizing entry where hi - lo <= 255: with u = x - lo in [0, 255] (x the code as above),
//     acc_b[n] = sum_k u[k] w[b, k, n] + lo * sum_k w[b, k, n]
// is the same exact integer (int32 lanes wrap, and the true sum fits: |acc_b| < 2^31). R rows share
// each weight vector: a 16-column vector holds 4 consecutive k per column, made from two rows of pairs
// of the layout above (zero-extended, the second shifted into the upper half). t and v as above: each
// block's float64 product added in ascending b, no FMA, one rounding to float32 per lane.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
void vnni_rows(const int32_t* const* uq, const int8_t* w, const float* s, int64_t nb, int64_t B, int64_t N,
               double s_x, float lo, float* const* out) {
    const int64_t pairs = (B + 1) / 2, quads = (B + 3) / 4;
    const __m512i ones = _mm512_set1_epi32(0x01010101), lo_v = _mm512_set1_epi32(static_cast<int32_t>(lo));
    const __m512d sx = _mm512_set1_pd(s_x);
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const __mmask16 m16 = N - n0 >= 16 ? static_cast<__mmask16>(0xffff)
                                           : static_cast<__mmask16>((1u << (N - n0)) - 1u);
        __m512d t[R][2];
        for (int64_t b = 0; b < nb; ++b) {
            const int8_t* wb = w + b * pairs * N * 2;
            __m512i acc[R];
            for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
            __m512i cs = _mm512_setzero_si512();
            for (int64_t g = 0; g < quads; ++g) {
                const __m512i w01 =
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m16, wb + (2 * g) * N * 2 + 2 * n0));
                const __m512i w23 = 2 * g + 1 < pairs
                    ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m16, wb + (2 * g + 1) * N * 2 + 2 * n0))
                    : _mm512_setzero_si512();
                const __m512i wv = _mm512_or_si512(w01, _mm512_slli_epi32(w23, 16));
                cs = _mm512_dpbusd_epi32(cs, ones, wv);
                for (int r = 0; r < R; ++r)
                    acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(uq[r][b * quads + g]), wv);
            }
            const __m512 sf = _mm512_maskz_loadu_ps(m16, s + b * N + n0);
            const __m512d s0 = _mm512_cvtps_pd(_mm512_castps512_ps256(sf));
            const __m512d s1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(sf, 1));
            const __m512i corr = _mm512_mullo_epi32(cs, lo_v);
            for (int r = 0; r < R; ++r) {
                const __m512i a = _mm512_add_epi32(acc[r], corr);
                const __m512d p0 = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(a)), s0);
                const __m512d p1 = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a, 1)), s1);
                if (b == 0) {
                    t[r][0] = p0;
                    t[r][1] = p1;
                } else {
                    t[r][0] = _mm512_add_pd(t[r][0], p0);
                    t[r][1] = _mm512_add_pd(t[r][1], p1);
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            _mm256_mask_storeu_ps(out[r] + n0, static_cast<__mmask8>(m16 & 0xff),
                                  _mm512_cvtpd_ps(_mm512_mul_pd(t[r][0], sx)));
            _mm256_mask_storeu_ps(out[r] + n0 + 8, static_cast<__mmask8>(m16 >> 8),
                                  _mm512_cvtpd_ps(_mm512_mul_pd(t[r][1], sx)));
        }
    }
}

// One row's u = code - lo, four k per int32 (byte i: k = 4g + i of block b; zero past B). Returns 1 + the
// flat index of the first NaN, else 0.
inline int64_t row_quads(const float* xm, int64_t flat0, int64_t nb, int64_t B, float s_in, float lo, float hi,
                         int32_t* uq) {
    const int64_t quads = (B + 3) / 4;
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t g = 0; g < quads; ++g) {
            uint32_t q = 0;
            for (int i = 0; i < 4; ++i) {
                const int64_t k = 4 * g + i;
                if (k >= B) break;
                float v = int_code_round(xm[b * B + k], s_in);
                if (v != v) return 1 + flat0 + b * B + k;
                v = int_code_clamp(v, lo, hi);
                q |= static_cast<uint32_t>(static_cast<int32_t>(v) - static_cast<int32_t>(lo)) << (8 * i);
            }
            uq[b * quads + g] = static_cast<int32_t>(q);
        }
    }
    return 0;
}

int64_t blocked_vnni(const float* in, int64_t M, const int8_t* w, const float* s, int64_t nb, int64_t B, int64_t N,
                     float s_in, float lo, float hi, double s_x, float* out) {
    const int64_t K = nb * B, per_row = nb * ((B + 3) / 4);
    std::vector<int32_t> uq(8 * per_row);
    for (int64_t m0 = 0; m0 < M;) {
        const int R = M - m0 >= 8 ? 8 : M - m0 >= 4 ? 4 : 1;
        const int32_t* rows[8];
        float* outs[8];
        for (int r = 0; r < R; ++r) {
            const int64_t bad = row_quads(in + (m0 + r) * K, (m0 + r) * K, nb, B, s_in, lo, hi,
                                          uq.data() + r * per_row);
            if (bad) return bad;
            rows[r] = uq.data() + r * per_row;
            outs[r] = out + (m0 + r) * N;
        }
        if (R == 8) {
            vnni_rows<8>(rows, w, s, nb, B, N, s_x, lo, outs);
        } else if (R == 4) {
            vnni_rows<4>(rows, w, s, nb, B, N, s_x, lo, outs);
        } else {
            vnni_rows<1>(rows, w, s, nb, B, N, s_x, lo, outs);
        }
        m0 += R;
    }
    return 0;
}
#endif

}  // namespace

extern "C" {

int dal_blocked_abi_version() { return 3; }

// Whether dal_blocked_linear_q takes the AVX-512 VNNI path on this CPU (for hi - lo <= 255).
int dal_blocked_vnni() {
#ifdef DAL_VNNI
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

// x [M, nb * B] float32 (integer values), w packed as above, s [nb, N] float32, out [M, N] float32.
// Returns 0, or 1 + the flat index of the first x that is not an integer in [-255, 255] (out is
// then incomplete: the caller raises).
int64_t dal_blocked_linear(const float* x, int64_t M, const int8_t* w, const float* s, int64_t nb, int64_t B,
                           int64_t N, double s_x, float* out) {
    return blocked(x, M, w, s, nb, B, N, s_x, out, 0, 1.0f, 0.0f, 0.0f);
}

// The same from the float32 input `in` [M, nb * B] (codes made as in the header; lo, hi integers with
// -255 <= lo <= hi <= 255, s_in > 0: the caller's). Returns 0, or 1 + the flat index of the first NaN.
// vnni: 1 takes the AVX-512 VNNI path where dal_blocked_vnni() and hi - lo <= 255, 0 the AVX2 / portable one
// (the same bits).
int64_t dal_blocked_linear_q(const float* in, int64_t M, const int8_t* w, const float* s, int64_t nb, int64_t B,
                             int64_t N, float s_in, float lo, float hi, double s_x, float* out, int vnni) {
#ifdef DAL_VNNI
    if (vnni && hi - lo <= 255.0f && dal_blocked_vnni())
        return blocked_vnni(in, M, w, s, nb, B, N, s_in, lo, hi, s_x, out);
#endif
    return blocked(in, M, w, s, nb, B, N, s_x, out, 1, s_in, lo, hi);
}

}  // extern "C"
