// The backward of LSQ / LSQ+ fake quantization in one pass (dal.kernels.lsq, dal::fake_quantize_lsq).
// The forward is dal::fake_quantize's kernel (csrc/fake_quant.cpp, dal_fq_forward without a mask);
// this pass recomputes each element's code from x, so nothing but x is kept from the forward.
//
// Per element, with the row's scale s and code bounds lo = qmin - zp, hi = qmax - zp (float32):
//     v = x / s                                   (IEEE division)
//     int:  r = round_half_even(v);  c = clamp(r, lo, hi);  inside = lo <= r <= hi  (= c == r)
//     fp8:  c = rne_to_fp8(clamp(v, -max, max));           inside = |v| <= max
//     local = inside ? c - v : c                  (float32)
//     dx    = g * (inside ? 1 : 0)                 (float32: NaN / inf gradients and -0 kept)
//     ts    = g * local                            (float32 product)
//     tz    = g * (inside ? 0 : -s)                (float32 product)
// and per parameter p:  ds[p] = float32(grad_scale * sum_double(ts)),  dzp[p] likewise from tz;
// each sum accumulated in double: per work item (a chunk of a row) in a fixed lane order, then the
// items of p in index order, so the result does not depend on the thread count.
// clamp keeps its argument unless strictly outside [lo, hi] (NaN stays NaN, -0 stays -0), as
// torch.clamp and fake_quant.cpp do.
//
// Plain C ABI (ctypes), no torch headers, built like fake_quant.cpp (dal.formats.native.compile_library).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fp8_round.h"

namespace {

constexpr int64_t kChunk = 16384;  // elements per work item

struct Sums { double s, z; };

// One element (scalar): dx and the two products.
inline void bwd_one(float g, float x, float s, float lo, float hi, int mode, float* dx, float* ts, float* tz) {
    float v = x / s;
    float c;
    bool inside;
    if (mode == MODE_INT) {
        float r = std::nearbyint(v);
        c = r < lo ? lo : r;
        c = c > hi ? hi : c;
        inside = (r >= lo) & (r <= hi);
    } else {
        int mant, emin;
        fp8_params(mode, &mant, &emin);
        float t = v < lo ? lo : v;
        t = t > hi ? hi : t;
        c = round_fp8(t, mant, emin);
        inside = std::fabs(v) <= hi;
    }
    float local = inside ? c - v : c;
    *dx = g * (inside ? 1.0f : 0.0f);
    *ts = g * local;
    *tz = g * (inside ? 0.0f : -s);
}

// Elements [begin, end) of one row; returns the double sums of ts and tz over them.
Sums bwd_span(const float* g, const float* x, float* dx, int64_t begin, int64_t end, float s, float lo, float hi,
              int mode, bool want_s, bool want_z) {
    int64_t i = begin;
    double sum_s = 0.0, sum_z = 0.0;
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(s), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    const __m256 neg_s = _mm256_xor_ps(vs, sign);
    int mant = 0, emin = 0;
    if (mode != MODE_INT) fp8_params(mode, &mant, &emin);
    const __m256i vemin = _mm256_set1_epi32(emin), vmant = _mm256_set1_epi32(mant);
    const __m256i v254 = _mm256_set1_epi32(254), vff = _mm256_set1_epi32(0xff);
    __m256d as0 = _mm256_setzero_pd(), as1 = as0, az0 = as0, az1 = as0;
    for (; i + 8 <= end; i += 8) {
        __m256 vg = _mm256_loadu_ps(g + i);
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vs);
        __m256 c, keep;
        if (mode == MODE_INT) {
            __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            // max_ps / min_ps return the second operand for a NaN: r kept unless strictly outside
            c = _mm256_min_ps(vhi, _mm256_max_ps(vlo, r));
            keep = _mm256_cmp_ps(c, r, _CMP_EQ_OQ);
        } else {
            // clamp by max_ps / min_ps (second operand returned for a NaN: v kept unless strictly outside)
            __m256 t = _mm256_min_ps(vhi, _mm256_max_ps(vlo, v));
            __m256i e = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(t), 23), vff);
            __m256i eq = _mm256_sub_epi32(_mm256_max_epi32(e, vemin), vmant);
            __m256 q = _mm256_castsi256_ps(_mm256_slli_epi32(eq, 23));
            __m256 inv_q = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(v254, eq), 23));
            c = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(t, inv_q), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), q);
            // a NaN t stays NaN through the scaling and rounding above (its payload is of no use here)
            keep = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), vhi, _CMP_LE_OQ);
        }
        if (dx) _mm256_storeu_ps(dx + i, _mm256_mul_ps(vg, _mm256_and_ps(keep, one)));
        if (want_s) {
            __m256 local = _mm256_blendv_ps(c, _mm256_sub_ps(c, v), keep);
            __m256 p = _mm256_mul_ps(vg, local);
            as0 = _mm256_add_pd(as0, _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
            as1 = _mm256_add_pd(as1, _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
        }
        if (want_z) {
            __m256 p = _mm256_mul_ps(vg, _mm256_blendv_ps(neg_s, zero, keep));
            az0 = _mm256_add_pd(az0, _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
            az1 = _mm256_add_pd(az1, _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
        }
    }
    double a[4];
    _mm256_storeu_pd(a, _mm256_add_pd(as0, as1));
    sum_s = (a[0] + a[1]) + (a[2] + a[3]);
    _mm256_storeu_pd(a, _mm256_add_pd(az0, az1));
    sum_z = (a[0] + a[1]) + (a[2] + a[3]);
#endif
    for (; i < end; ++i) {
        float d, ts, tz;
        bwd_one(g[i], x[i], s, lo, hi, mode, &d, &ts, &tz);
        if (dx) dx[i] = d;
        sum_s += (double)ts;
        sum_z += (double)tz;
    }
    return {sum_s, sum_z};
}

}  // namespace

extern "C" {

// g, x: rows * row_len contiguous floats laid out alike; row r uses parameter p = (r / param_div) %
// param_mod of scale, lo, hi. dx: rows * row_len floats or null (no gradient for x). ds, dzp:
// param_mod floats or null, written as float32(grad_scale * the double sum of the header).
void dal_lsq_backward(const float* g, const float* x, float* dx, float* ds, float* dzp, int64_t rows,
                      int64_t row_len, int64_t param_div, int64_t param_mod, const float* scale, const float* lo,
                      const float* hi, int mode, double grad_scale, int nthreads) {
    const int64_t chunks = (row_len + kChunk - 1) / kChunk;
    const int64_t items = rows * chunks;
    const bool want_s = ds != nullptr, want_z = dzp != nullptr;
    std::vector<Sums> part(want_s || want_z ? items : 0);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && items > 1)
    for (int64_t it = 0; it < items; ++it) {
        int64_t r = it / chunks, k = it % chunks;
        int64_t p = (r / param_div) % param_mod;
        int64_t begin = k * kChunk, end = begin + kChunk < row_len ? begin + kChunk : row_len;
        Sums sums = bwd_span(g + r * row_len, x + r * row_len, dx ? dx + r * row_len : nullptr, begin, end,
                             scale[p], lo[p], hi[p], mode, want_s, want_z);
        if (want_s || want_z) part[it] = sums;
    }
    if (!(want_s || want_z)) return;
    std::vector<double> acc_s(param_mod, 0.0), acc_z(param_mod, 0.0);
    for (int64_t it = 0; it < items; ++it) {
        int64_t p = ((it / chunks) / param_div) % param_mod;
        acc_s[p] += part[it].s;
        acc_z[p] += part[it].z;
    }
    for (int64_t p = 0; p < param_mod; ++p) {
        if (ds) ds[p] = (float)(acc_s[p] * grad_scale);
        if (dzp) dzp[p] = (float)(acc_z[p] * grad_scale);
    }
}

int dal_lsq_abi_version() { return 1; }

}  // extern "C"
