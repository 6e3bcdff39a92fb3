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
// Also here: per-row min / max (dal_row_minmax, the per-channel observers), the BN-folded
// weight of QConvBn2d training (dal_fold_forward / dal_fold_backward, dal.formats.fold), a QAT
// quantizer's observer step, alone or fused with its fake quantization (dal_track_qparams,
// dal_track_fq_forward, dal_fq_forward_fixed: dal.formats.track), and the backward of the 1/f
// on QConvBn2d's conv output (dal_channel_divide_backward, dal.nn.channel_divide), and the int32
// bias with its scale s_in * s_w (dal_bias_fq_forward, dal.formats.bias).
// And the FP16 / BF16 cast round trip of an FP16 island (dal_fp_cast_round_trip, dal.formats.fp_cast), and
// and QConvBn2d's training fold factor gamma / sqrt(var + eps) (dal_fold_factor, dal.formats.fold_factor).
//
// Plain C ABI (called through ctypes): no torch headers, so it builds in about a second.
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
#include "int_code.h"

namespace {

// The float32 NaN that torch produces when it widens the FP8 NaN back (sign kept): the eager
// path goes through a real FP8 tensor, so its NaNs carry this payload.
inline uint32_t fp8_nan_bits(int mode) { return mode == MODE_E4M3 ? 0x7ff00000u : 0x7fe00000u; }

// One scalar element; returns the mask bit.
inline int fq_one(float x, float s, float lo, float hi, int mode, float* out) {
    float v = x / s;
    if (mode == MODE_INT) {
        float r = int_code_round(x, s);
        *out = int_code_clamp(r, lo, hi) * s;
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

#ifdef __AVX2__
// The vector constants of one (s, lo, hi, mode).
struct Vq {
    __m256 s, lo, hi, sign, nan;
    __m256i emin, mant, v254, vff;
    int mode;
    Vq(float s_, float lo_, float hi_, int mode_) : mode(mode_) {
        s = _mm256_set1_ps(s_); lo = _mm256_set1_ps(lo_); hi = _mm256_set1_ps(hi_);
        sign = _mm256_set1_ps(-0.0f);
        int mant_ = 0, emin_ = 0;
        if (mode != MODE_INT) fp8_params(mode, &mant_, &emin_);
        emin = _mm256_set1_epi32(emin_); mant = _mm256_set1_epi32(mant_);
        v254 = _mm256_set1_epi32(254); vff = _mm256_set1_epi32(0xff);
        nan = _mm256_castsi256_ps(_mm256_set1_epi32((int)(mode == MODE_INT ? 0 : fp8_nan_bits(mode))));
    }
};

// 8 lanes of v = x / s: returns c * s (the fake-quantized value) and the mask in *keep.
inline __m256 quant8(__m256 v, const Vq& k, __m256* keep) {
    __m256 c;
    if (k.mode == MODE_INT) {
        __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // clamp as torch.clamp: max_ps / min_ps return their second operand for a NaN or for
        // equal values (+0 / -0), so r is kept unless strictly outside [lo, hi]. Then the mask
        // lo <= r <= hi is exactly c == r (a NaN r compares unequal, as it fails lo <= r).
        c = _mm256_min_ps(k.hi, _mm256_max_ps(k.lo, r));
        *keep = _mm256_cmp_ps(c, r, _CMP_EQ_OQ);
    } else {
        __m256 t = _mm256_blendv_ps(v, k.lo, _mm256_cmp_ps(v, k.lo, _CMP_LT_OQ));
        t = _mm256_blendv_ps(t, k.hi, _mm256_cmp_ps(t, k.hi, _CMP_GT_OQ));
        __m256i e = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(t), 23), k.vff);
        __m256i eq = _mm256_sub_epi32(_mm256_max_epi32(e, k.emin), k.mant);
        __m256 q = _mm256_castsi256_ps(_mm256_slli_epi32(eq, 23));
        __m256 inv_q = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(k.v254, eq), 23));
        c = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(t, inv_q),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), q);
        c = _mm256_blendv_ps(c, _mm256_or_ps(_mm256_and_ps(t, k.sign), k.nan), _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
        *keep = _mm256_cmp_ps(_mm256_andnot_ps(k.sign, v), k.hi, _CMP_LE_OQ);
    }
    return _mm256_mul_ps(c, k.s);
}
#endif

// Elements [begin, end) of one row (begin is a multiple of 8); mask points at the row's bytes.
void fq_span(const float* x, float* out, uint8_t* mask, int64_t begin, int64_t end,
             float s, float lo, float hi, int mode) {
    int64_t i = begin;
#ifdef __AVX2__
    const Vq k(s, lo, hi, mode);
    for (; i + 8 <= end; i += 8) {
        __m256 keep;
        _mm256_storeu_ps(out + i, quant8(_mm256_div_ps(_mm256_loadu_ps(x + i), k.s), k, &keep));
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

// kMaskRows[b]: the 8 floats (0 or 1) of mask byte b, bit j -> element j (one aligned load per byte).
struct MaskRows {
    alignas(32) float v[256][8];
    constexpr MaskRows() : v() {
        for (int b = 0; b < 256; ++b)
            for (int j = 0; j < 8; ++j) v[b][j] = (b >> j) & 1 ? 1.0f : 0.0f;
    }
};
constexpr MaskRows kMaskRows{};

void bwd_span(const float* g, const uint8_t* mask, float* gin, int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef __AVX2__
    for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(gin + i, _mm256_mul_ps(_mm256_loadu_ps(g + i), _mm256_load_ps(kMaskRows.v[mask[i >> 3]])));
#endif
    for (; i < end; ++i)
        gin[i] = g[i] * (float)((mask[i >> 3] >> (i & 7)) & 1);
}

// ---- the BN-folded weight of QConvBn2d training (dal.formats.fold) -------------------------
// Forward, per element of row r (output channel) with f = f[r]:
//     t = w * f;  q = fake_quant(t) as above, mask m;  out = divide ? q / f : q
// Backward, from g = d loss / d out, the stored mask and (divide) the stored out:
//     divide:  grad_w = ((g / f) * m) * f       grad_f = sum(g * (m * w - out)) / f
//     else:    grad_w = (g * m) * f             grad_f = sum(g * m * w)
// out and grad_w are the float32 expressions torch's autograd evaluates for t = w * f, fq, q / f,
// so they are bit-identical to that chain. grad_f is that chain's sum(gq * m * w) - sum(g * q / f^2)
// in exact arithmetic (out = q / f rounded once), accumulated in double, one row per thread
// (deterministic for any thread count): torch's float32 sums cancel where this does not.

void fold_span(const float* w, float* out, uint8_t* mask, int64_t n, float fr, float s, float lo, float hi,
               int mode, int divide) {
    int64_t i = 0;
#ifdef __AVX2__
    const Vq k(s, lo, hi, mode);
    const __m256 vf = _mm256_set1_ps(fr);
    for (; i + 8 <= n; i += 8) {
        __m256 keep;
        __m256 q = quant8(_mm256_div_ps(_mm256_mul_ps(_mm256_loadu_ps(w + i), vf), k.s), k, &keep);
        _mm256_storeu_ps(out + i, divide ? _mm256_div_ps(q, vf) : q);
        if (mask) mask[i >> 3] = (uint8_t)_mm256_movemask_ps(keep);
    }
#endif
    for (; i < n; i += 8) {
        uint8_t byte = 0;
        int64_t stop = i + 8 < n ? i + 8 : n;
        for (int64_t j = i; j < stop; ++j) {
            float q;
            byte |= (uint8_t)(fq_one(w[j] * fr, s, lo, hi, mode, &q) << (j - i));
            out[j] = divide ? q / fr : q;
        }
        if (mask) mask[i >> 3] = byte;
    }
}

#ifdef __AVX2__
inline double hsum(__m256d v) {
    double a[4];
    _mm256_storeu_pd(a, v);
    return (a[0] + a[1]) + (a[2] + a[3]);
}

inline __m256d lo_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
inline __m256d hi_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }
#endif

// One row: grad_w (or null) and the double sum of grad_f's formula (before the division by f).
double fold_bwd_span(const float* g, const float* w, const float* out, const uint8_t* mask, float* gw, int64_t n,
                     float fr, int divide) {
    int64_t i = 0;
    double sum = 0.0;
#ifdef __AVX2__
    const __m256 vf = _mm256_set1_ps(fr);
    __m256d acc = _mm256_setzero_pd();
    for (; i + 8 <= n; i += 8) {
        __m256 m = _mm256_load_ps(kMaskRows.v[mask[i >> 3]]);
        __m256 vg = _mm256_loadu_ps(g + i), vw = _mm256_loadu_ps(w + i);
        if (gw) {
            __m256 gt = _mm256_mul_ps(divide ? _mm256_div_ps(vg, vf) : vg, m);
            _mm256_storeu_ps(gw + i, _mm256_mul_ps(gt, vf));
        }
        __m256 mw = _mm256_mul_ps(m, vw);  // exact: m is 0 or 1
        __m256d d_lo = lo_pd(mw), d_hi = hi_pd(mw);
        if (divide) {  // exact in double: two floats of similar size
            __m256 vo = _mm256_loadu_ps(out + i);
            d_lo = _mm256_sub_pd(d_lo, lo_pd(vo));
            d_hi = _mm256_sub_pd(d_hi, hi_pd(vo));
        }
        acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_mul_pd(lo_pd(vg), d_lo), _mm256_mul_pd(hi_pd(vg), d_hi)));
    }
    sum = hsum(acc);
#endif
    for (; i < n; ++i) {
        float m = (float)((mask[i >> 3] >> (i & 7)) & 1);
        if (gw) gw[i] = ((divide ? g[i] / fr : g[i]) * m) * fr;
        double d = (double)(m * w[i]) - (divide ? (double)out[i] : 0.0);
        sum += (double)g[i] * d;
    }
    return sum;
}

// min and max of x[0, n), ignoring NaN; *nan tells whether there was one.
void minmax_span(const float* x, int64_t n, float* mn, float* mx, bool* nan) {
    int64_t i = 0;
    float lo = INFINITY, hi = -INFINITY;
    bool bad = false;
#ifdef __AVX2__
    if (n >= 8) {
        __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            vlo = _mm256_min_ps(v, vlo);  // a NaN in v returns the second operand: NaN is skipped
            vhi = _mm256_max_ps(v, vhi);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float a[8], b[8];
        _mm256_storeu_ps(a, vlo);
        _mm256_storeu_ps(b, vhi);
        for (int j = 0; j < 8; ++j) {
            lo = a[j] < lo ? a[j] : lo;
            hi = b[j] > hi ? b[j] : hi;
        }
        bad = _mm256_movemask_ps(vnan) != 0;
    }
#endif
    for (; i < n; ++i) {
        float v = x[i];
        if (v != v) { bad = true; continue; }
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *mn = lo;
    *mx = hi;
    *nan = bad;
}

// min and max of x[0, n) like minmax_span, and which zeros occur: *pos0 / *neg0 tell whether a
// +0 / -0 is among the elements. When an extreme is zero, the zeros are exactly the extreme
// elements, so these two flags decide its sign (both set: ambiguous, the caller declines).
void range_span(const float* x, int64_t n, float* mn, float* mx, bool* nan, bool* pos0, bool* neg0) {
    int64_t i = 0;
    float lo = INFINITY, hi = -INFINITY;
    bool bad = false, p0 = false, n0 = false;
#ifdef __AVX2__
    if (n >= 16) {
        const __m256 zero = _mm256_setzero_ps();
        __m256 lo0 = _mm256_set1_ps(INFINITY), hi0 = _mm256_set1_ps(-INFINITY), lo1 = lo0, hi1 = hi0;
        __m256 vnan = zero, vneg = zero, vpos = zero;
        for (; i + 16 <= n; i += 16) {  // two accumulators: the loop is bound by loads, not latency
            __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
            lo0 = _mm256_min_ps(a, lo0);  // a NaN in a returns the second operand: NaN is skipped
            hi0 = _mm256_max_ps(a, hi0);
            lo1 = _mm256_min_ps(b, lo1);
            hi1 = _mm256_max_ps(b, hi1);
            vnan = _mm256_or_ps(vnan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
            __m256 za = _mm256_cmp_ps(a, zero, _CMP_EQ_OQ), zb = _mm256_cmp_ps(b, zero, _CMP_EQ_OQ);
            // sign bit of (zero-lane & x): a -0 was seen; of (zero-lane & ~x): a +0 was seen
            vneg = _mm256_or_ps(vneg, _mm256_or_ps(_mm256_and_ps(za, a), _mm256_and_ps(zb, b)));
            vpos = _mm256_or_ps(vpos, _mm256_or_ps(_mm256_andnot_ps(a, za), _mm256_andnot_ps(b, zb)));
        }
        float a[8], b[8];
        _mm256_storeu_ps(a, _mm256_min_ps(lo0, lo1));  // min / max of non-NaN values: exact in any order
        _mm256_storeu_ps(b, _mm256_max_ps(hi0, hi1));
        for (int j = 0; j < 8; ++j) {
            lo = a[j] < lo ? a[j] : lo;
            hi = b[j] > hi ? b[j] : hi;
        }
        bad = _mm256_movemask_ps(vnan) != 0;
        n0 = _mm256_movemask_ps(vneg) != 0;
        p0 = _mm256_movemask_ps(vpos) != 0;
    }
#endif
    for (; i < n; ++i) {
        float v = x[i];
        if (v != v) { bad = true; continue; }
        if (v == 0.0f) (std::signbit(v) ? n0 : p0) = true;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *mn = lo;
    *mx = hi;
    *nan = bad;
    *pos0 = p0;
    *neg0 = n0;
}

// The observer step of one scale (formulas at dal_track_qparams).
struct Track {
    int ema;
    float c;
    int symmetric;
    double qmin, qmax, zp_mid, denom;
    int fp8;
};

inline bool track_ok(const Track& t, float blo, float bhi, float mn, float mx) {
    if (!std::isfinite(blo) || !std::isfinite(bhi)) return false;
    return t.ema || (std::isfinite(mn) && std::isfinite(mx) && mn != 0.0f && mx != 0.0f && blo != 0.0f && bhi != 0.0f);
}

inline void track_one(const Track& t, float blo, float bhi, float* min_val, float* max_val, float* scale,
                      int32_t* zero_point, float* s_out, float* k_lo, float* k_hi) {
    if (t.ema) {
        bool first = !std::isfinite(*min_val);
        float mn = *min_val + t.c * (blo - *min_val);
        float mx = *max_val + t.c * (bhi - *max_val);
        *min_val = first ? blo : mn;
        *max_val = first ? bhi : mx;
    } else {
        *min_val = blo < *min_val ? blo : *min_val;
        *max_val = bhi > *max_val ? bhi : *max_val;
    }
    float lo_f = std::isfinite(*min_val) ? *min_val : 0.0f;
    float hi_f = std::isfinite(*max_val) ? *max_val : 0.0f;
    hi_f = hi_f > lo_f ? hi_f : lo_f;
    double l = (double)(lo_f < 0.0f ? lo_f : 0.0f), h = (double)(hi_f > 0.0f ? hi_f : 0.0f);
    double sc, zp;
    if (t.symmetric || t.fp8) {
        sc = (-l > h ? -l : h) / t.denom;
        zp = t.zp_mid;
    } else {
        sc = (h - l) / (t.qmax - t.qmin);
        double z = t.qmin - std::nearbyint(l / (sc > 0.0 ? sc : 1.0));
        zp = z < t.qmin ? t.qmin : (z > t.qmax ? t.qmax : z);
    }
    sc = sc > 0.0 ? sc : 1.0;
    sc = sc < 0x1p-100 ? 0x1p-100 : sc;
    float s32 = (float)sc;
    *scale = s32;
    *zero_point = (int32_t)zp;
    *s_out = s32;
    float z32 = (float)(int32_t)zp;
    *k_lo = t.fp8 ? (float)-t.denom : (float)t.qmin - z32;
    *k_hi = t.fp8 ? (float)t.denom : (float)t.qmax - z32;
}

constexpr int64_t kChunk = 16384;  // elements per work item (a multiple of 8: mask bytes align)

// x, out: rows * row_len contiguous floats. Row r uses parameter p = (r / param_div) % param_mod
// of scale, lo, hi. mask: rows * ceil(row_len / 8) bytes, or null when no gradient is needed.
void fq_rows(const float* x, float* out, uint8_t* mask, int64_t rows, int64_t row_len, int64_t param_div,
             int64_t param_mod, const float* scale, const float* lo, const float* hi, int mode, int nthreads) {
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


}  // namespace

extern "C" {

// The fused fake quantization (arguments as fq_rows).
void dal_fq_forward(const float* x, float* out, uint8_t* mask, int64_t rows, int64_t row_len,
                    int64_t param_div, int64_t param_mod, const float* scale, const float* lo,
                    const float* hi, int mode, int nthreads) {
    fq_rows(x, out, mask, rows, row_len, param_div, param_mod, scale, lo, hi, mode, nthreads);
}

// 1 when every element's bit of a forward mask (rows x ceil(row_len / 8) bytes, the bits past
// row_len zero) is set: nothing was clipped and the straight-through backward is the identity.
int dal_mask_all_set(const uint8_t* mask, int64_t rows, int64_t row_len) {
    const int64_t mask_row = (row_len + 7) / 8, full = row_len / 8;
    const uint8_t last = (uint8_t)((1u << (row_len % 8)) - 1u);
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* m = mask + r * mask_row;
        int64_t i = 0;
        for (; i + 8 <= full; i += 8) {
            uint64_t w;
            std::memcpy(&w, m + i, 8);
            if (w != ~(uint64_t)0) return 0;
        }
        for (; i < full; ++i)
            if (m[i] != 0xFF) return 0;
        if (full < mask_row && m[full] != last) return 0;
    }
    return 1;
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

// Per row r of x (rows x row_len floats): min and max of x[r, :] * f[r] (f null: of x[r, :]) into
// mn[r], mx[r]. Returns 1 when no element is NaN and every extreme is finite and nonzero, and f
// (if given) is finite and nonzero: the extremes are then the exact min / max of the float32
// products (IEEE multiplication by one f is monotonic). Otherwise 0: the caller takes torch's
// amin / amax of the product (which also decides the sign of a zero extreme).
int dal_row_minmax(const float* x, int64_t rows, int64_t row_len, const float* f, float* mn, float* mx,
                   int nthreads) {
    int ok = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(&& : ok) if (nthreads > 1 && rows * row_len > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        float lo, hi;
        bool nan;
        minmax_span(x + r * row_len, row_len, &lo, &hi, &nan);
        if (f) {
            float fr = f[r], a = fr * lo, b = fr * hi;
            ok = ok && fr != 0.0f && std::isfinite(fr);
            lo = fr > 0.0f ? a : b;
            hi = fr > 0.0f ? b : a;
        }
        ok = ok && !nan && std::isfinite(lo) && std::isfinite(hi) && lo != 0.0f && hi != 0.0f;
        mn[r] = lo;
        mx[r] = hi;
    }
    return ok;
}

// The folded weight of QConvBn2d (formulas above fold_span). Row r of w uses f[r] and the
// quantization parameter p = (r / param_div) % param_mod of scale, lo, hi. mask: rows *
// ceil(row_len / 8) bytes (bit-packed as for dal_fq_forward), or null when no gradient is needed.
void dal_fold_forward(const float* w, float* out, uint8_t* mask, int64_t rows, int64_t row_len, int64_t param_div,
                      int64_t param_mod, const float* f, const float* scale, const float* lo, const float* hi,
                      int mode, int divide, int nthreads) {
    const int64_t mask_row = (row_len + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && rows * row_len > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        int64_t p = (r / param_div) % param_mod;
        fold_span(w + r * row_len, out + r * row_len, mask ? mask + r * mask_row : nullptr, row_len, f[r],
                  scale[p], lo[p], hi[p], mode, divide);
    }
}

// grad_w (rows x row_len, or null) and grad_f (rows, or null) from grad (rows x row_len), the
// forward's mask and, when divide, its out.
void dal_fold_backward(const float* grad, const float* w, const float* out, const uint8_t* mask, float* grad_w,
                       float* grad_f, int64_t rows, int64_t row_len, const float* f, int divide, int nthreads) {
    const int64_t mask_row = (row_len + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && rows * row_len > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        double sum = fold_bwd_span(grad + r * row_len, w + r * row_len, divide ? out + r * row_len : nullptr,
                                   mask + r * mask_row, grad_w ? grad_w + r * row_len : nullptr, row_len, f[r],
                                   divide);
        if (grad_f) grad_f[r] = (float)(divide ? sum / (double)f[r] : sum);
    }
}

// ---- the observer step of a quantizer in QAT (dal.quantizer's fast path) ---------------------
// One call replaces the ~30 small torch ops of MinMaxObserver / MovingAverageMinMaxObserver
// update + Observer.calculate_qparams + formats.choose_qparams + FakeQuantizer.set_qparams, with
// the same float32 / float64 expressions in the same order (the Python versions are the spec):
//     minmax:  min_val = min(min_val, lo)          max_val = max(max_val, hi)
//     ema:     first = !isfinite(min_val);  m = first ? lo : min_val + c * (lo - min_val)  (float32, c float32)
//     range:   l = double(min(finite-or-0(min_val), 0)),  h = double(max(finite-or-0(max_val), 0))
//     sym/fp8: scale = max(-l, h) / denom,  zp = zp_mid
//     affine:  scale = (h - l) / (qmax - qmin);  zp = clamp(qmin - rne(l / (scale > 0 ? scale : 1)), qmin, qmax)
//     scale = float32(max(scale > 0 ? scale : 1, 2^-100))
// and the kernel's bounds k_lo = qmin - zp, k_hi = qmax - zp (fp8: -+denom) and a copy of the
// scale for this call. Returns 0, having written nothing, where the torch path must decide: a
// non-finite batch extreme, and for minmax any zero or non-finite value among the four inputs
// (torch's min / max of +0 and -0 depend on its kernel's operand order).
int dal_track_qparams(const float* blo, const float* bhi, int64_t n, float* min_val, float* max_val,
                      int64_t* batches_seen, int ema, float c, int symmetric, double qmin, double qmax,
                      double zp_mid, double denom, int fp8, float* scale, int32_t* zero_point, float* s_out,
                      float* k_lo, float* k_hi) {
    const Track t{ema, c, symmetric, qmin, qmax, zp_mid, denom, fp8};
    for (int64_t i = 0; i < n; ++i)
        if (!track_ok(t, blo[i], bhi[i], min_val[i], max_val[i])) return 0;
    for (int64_t i = 0; i < n; ++i)
        track_one(t, blo[i], bhi[i], min_val + i, max_val + i, scale + i, zero_point + i, s_out + i, k_lo + i, k_hi + i);
    *batches_seen += 1;
    return 1;
}

// dal_track_qparams of a per-output-channel weight quantizer fused with dal_fold_forward: per row,
// the extremes of w * f (as dal_row_minmax), that row's observer step and scale, then the row's
// fold forward while it is still in L1, so W is read once instead of twice. Returns 0 with no
// observer state or scale written (out and mask are then garbage) where either would decline.
// f null: no fold (divide ignored): dal_row_minmax of w, dal_track_qparams, then dal_fq_forward of
// each row with its parameters, in one call (a per-channel weight quantizer's QAT step).
int dal_fold_track_forward(const float* w, float* out, uint8_t* mask, int64_t rows, int64_t row_len, const float* f,
                           float* min_val, float* max_val, int64_t* batches_seen, int ema, float c, int symmetric,
                           double qmin, double qmax, double zp_mid, double denom, int fp8, float* scale,
                           int32_t* zero_point, float* s_out, float* k_lo, float* k_hi, int mode, int divide,
                           int nthreads) {
    const Track t{ema, c, symmetric, qmin, qmax, zp_mid, denom, fp8};
    const int64_t mask_row = (row_len + 7) / 8;
    std::vector<float> new_min(rows), new_max(rows), new_scale(rows);
    std::vector<int32_t> new_zp(rows);
    int ok = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(&& : ok) if (nthreads > 1 && rows * row_len > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        if (!ok) continue;
        float lo, hi, fr = f ? f[r] : 1.0f;
        bool nan;
        minmax_span(w + r * row_len, row_len, &lo, &hi, &nan);
        if (f) {
            float a = fr * lo, b = fr * hi;
            lo = fr > 0.0f ? a : b;
            hi = fr > 0.0f ? b : a;
        }
        if (!(fr != 0.0f && std::isfinite(fr) && !nan && std::isfinite(lo) && std::isfinite(hi) && lo != 0.0f &&
              hi != 0.0f && track_ok(t, lo, hi, min_val[r], max_val[r]))) {
            ok = 0;
            continue;
        }
        new_min[r] = min_val[r];
        new_max[r] = max_val[r];
        track_one(t, lo, hi, &new_min[r], &new_max[r], &new_scale[r], &new_zp[r], s_out + r, k_lo + r, k_hi + r);
        if (f)
            fold_span(w + r * row_len, out + r * row_len, mask ? mask + r * mask_row : nullptr, row_len, fr, s_out[r],
                      k_lo[r], k_hi[r], mode, divide);
        else
            fq_span(w + r * row_len, out + r * row_len, mask ? mask + r * mask_row : nullptr, 0, row_len, s_out[r],
                    k_lo[r], k_hi[r], mode);
    }
    if (!ok) return 0;
    for (int64_t r = 0; r < rows; ++r) {
        min_val[r] = new_min[r];
        max_val[r] = new_max[r];
        scale[r] = new_scale[r];
        zero_point[r] = new_zp[r];
    }
    *batches_seen += 1;
    return 1;
}

// The kernel's parameters of a fixed (scale, zero point): s (a copy), lo = qmin - zp, hi = qmax - zp
// (float32, as fused.kernel_params computes them; fp8: -+fp8_max, zero point unused).
void dal_kernel_params(const float* scale, const int32_t* zero_point, int64_t n, double qmin, double qmax,
                       double fp8_max, float* s_out, float* k_lo, float* k_hi) {
    for (int64_t i = 0; i < n; ++i) {
        s_out[i] = scale[i];
        float z32 = zero_point ? (float)zero_point[i] : 0.0f;
        k_lo[i] = fp8_max > 0 ? (float)-fp8_max : (float)qmin - z32;
        k_hi[i] = fp8_max > 0 ? (float)fp8_max : (float)qmax - z32;
    }
}

// dal_fq_forward with the parameters of a fixed (scale, zero point) computed here, as
// dal_kernel_params computes them: one call per fake quantization in the frozen state (and in
// quantize with an observer that does not move the scale), no parameter tensors.
// scale, zero_point: param_mod values (zero_point null for FP8).
void dal_fq_forward_fixed(const float* x, float* out, uint8_t* mask, int64_t rows, int64_t row_len,
                          int64_t param_div, int64_t param_mod, const float* scale, const int32_t* zero_point,
                          double qmin, double qmax, double fp8_max, int mode, int nthreads) {
    std::vector<float> s(param_mod), lo(param_mod), hi(param_mod);
    dal_kernel_params(scale, zero_point, param_mod, qmin, qmax, fp8_max, s.data(), lo.data(), hi.data());
    fq_rows(x, out, mask, rows, row_len, param_div, param_mod, s.data(), lo.data(), hi.data(), mode, nthreads);
}

// The int32 bias of a layer with integer input and weight (dal.formats.bias): its scale is the
// float32 product s_in * s_w[c] (s_w: n_w values, 1 or one per output channel), zero point 0,
// as QATModule.bias_scale and the exporter compute it; then the fake quantization of b (n values)
// with the kernel's int32 bounds k_lo = (float)qmin - 0, k_hi = (float)qmax - 0 (dal_kernel_params).
void dal_bias_fq_forward(const float* b, float* out, uint8_t* mask, int64_t n, const float* s_in, const float* s_w,
                         int64_t n_w, double qmin, double qmax) {
    std::vector<float> s(n_w), lo(n_w), hi(n_w);
    for (int64_t i = 0; i < n_w; ++i) s[i] = s_in[0] * s_w[i];
    dal_kernel_params(s.data(), nullptr, n_w, qmin, qmax, 0.0, s.data(), lo.data(), hi.data());
    // per channel: one row per value (row_len 1); per tensor: one row of n
    fq_rows(b, out, mask, n_w == 1 ? 1 : n, n_w == 1 ? n : 1, 1, n_w, s.data(), lo.data(), hi.data(), MODE_INT, 1);
}

// dal_track_qparams of a per-tensor quantizer fused with dal_fq_forward, for the QAT step of an
// activation: the batch's min / max of x (torch.aminmax's values: exact for any order, and the
// sign of a zero extreme taken from the zeros present), the observer step and scale, then the
// fake quantization of x with this call's parameters into out / mask (null: no gradient); out may
// be x (elementwise, each value read before it is written).
// Returns 0 with no observer state or scale written (and, in place, x as it was: every check comes
// before the first write into x) where the torch path must decide: a
// NaN in x, a zero extreme with zeros of both signs present (torch's
// sign then depends on its reduction order) unless the observer is a moving average with a finite
// range (its step is then the same for either sign), or where dal_track_qparams would decline.
// Out of place (out != x) out and mask are then garbage.
//
// One pass over x where it can (running min / max, out != x, a finite nonzero range): the
// observer's range only moves when a batch leaves it, so the parameters of a batch inside the
// range are known before its extremes are (track_one of the range itself). Each chunk's extremes and
// its fake quantization with those parameters are computed while the chunk is in cache; when the
// step's real parameters (s, k_lo, k_hi) differ in any bit, a second pass quantizes x again with
// them. out and mask are a function of (s, k_lo, k_hi, mode) alone, so either way they are the
// two-pass result bit for bit. A moving average moves at every step: it always takes two passes.
int dal_track_fq_forward(const float* x, float* out, uint8_t* mask, int64_t n, float* min_val, float* max_val,
                         int64_t* batches_seen, int ema, float c, int symmetric, double qmin, double qmax,
                         double zp_mid, double denom, int fp8, float* scale, int32_t* zero_point, int mode,
                         int nthreads) {
    float lo = INFINITY, hi = -INFINITY;
    bool nan = false, p0 = false, n0 = false;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    const Track t{ema, c, symmetric, qmin, qmax, zp_mid, denom, fp8};
    // The speculative parameters (function doc): those of a batch inside the running range.
    const bool guess = !ema && out != x && std::isfinite(*min_val) && std::isfinite(*max_val) && *min_val != 0.0f &&
                       *max_val != 0.0f;
    float g_s = 0.0f, g_lo = 0.0f, g_hi = 0.0f;
    if (guess) {
        float m0 = *min_val, m1 = *max_val, g_scale;
        int32_t g_zp;
        track_one(t, m0, m1, &m0, &m1, &g_scale, &g_zp, &g_s, &g_lo, &g_hi);
    }
    if (guess || (nthreads > 1 && chunks > 4)) {
        std::vector<float> los(chunks), his(chunks);
        std::vector<char> flags(3 * chunks);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 1)
        for (int64_t k = 0; k < chunks; ++k) {
            int64_t begin = k * kChunk, len = begin + kChunk < n ? kChunk : n - begin;
            bool a, b, d;
            range_span(x + begin, len, &los[k], &his[k], &a, &b, &d);
            if (guess) fq_span(x, out, mask, begin, begin + len, g_s, g_lo, g_hi, mode);  // the chunk is in cache
            flags[3 * k] = a; flags[3 * k + 1] = b; flags[3 * k + 2] = d;
        }
        for (int64_t k = 0; k < chunks; ++k) {
            lo = los[k] < lo ? los[k] : lo;
            hi = his[k] > hi ? his[k] : hi;
            nan |= flags[3 * k] != 0; p0 |= flags[3 * k + 1] != 0; n0 |= flags[3 * k + 2] != 0;
        }
    } else {
        range_span(x, n, &lo, &hi, &nan, &p0, &n0);
    }
    // A zero extreme with zeros of both signs present: torch.aminmax's sign depends on its reduction
    // order. The moving average does not depend on it once its range is finite: m + c * (+-0 - m)
    // is m + c * -m for m != 0, and +0 for m = +-0, whichever the sign (RNE: -0 - -0 = +0, +0 + -0 = +0).
    const bool lo_both = lo == 0.0f && p0 && n0, hi_both = hi == 0.0f && p0 && n0;
    if (nan || (lo_both && !(ema && std::isfinite(*min_val))) || (hi_both && !(ema && std::isfinite(*max_val))))
        return 0;
    if (lo == 0.0f) lo = n0 && !lo_both ? -0.0f : 0.0f;
    if (hi == 0.0f) hi = n0 && !hi_both ? -0.0f : 0.0f;
    if (!track_ok(t, lo, hi, *min_val, *max_val)) return 0;
    float new_min = *min_val, new_max = *max_val, new_scale, s, k_lo, k_hi;
    int32_t new_zp;
    track_one(t, lo, hi, &new_min, &new_max, &new_scale, &new_zp, &s, &k_lo, &k_hi);
    const bool same = guess && float_to_bits(s) == float_to_bits(g_s) && float_to_bits(k_lo) == float_to_bits(g_lo) &&
                      float_to_bits(k_hi) == float_to_bits(g_hi);
    if (!same) fq_rows(x, out, mask, 1, n, 1, 1, &s, &k_lo, &k_hi, mode, nthreads);
    *min_val = new_min;
    *max_val = new_max;
    *scale = new_scale;
    *zero_point = new_zp;
    *batches_seen += 1;
    return 1;
}

// ---- z = y / f per channel, the 1/f of QConvBn2d training on the conv output (dal.nn.channel_divide) ----
// The backward of torch's broadcast division z = y / f[c] (y: outer x C x inner floats), in one
// pass and with autograd's own float32 expressions (DivBackward0):
//     grad_y = g / f[c]                  t = (-g) * ((y / f[c]) / f[c])
// grad_y or t may be null. The caller sums t over every axis but C with torch's own reduction
// (the sum_to autograd applies), so grad_f keeps torch's bits too.
void dal_channel_divide_backward(const float* g, const float* y, const float* f, float* grad_y, float* t,
                                 int64_t outer, int64_t channels, int64_t inner, int nthreads) {
    const int64_t items = outer * channels;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && items * inner > 65536)
    for (int64_t it = 0; it < items; ++it) {
        const float fr = f[it % channels];
        const int64_t off = it * inner;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 vf = _mm256_set1_ps(fr), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inner; i += 8) {
            __m256 vg = _mm256_loadu_ps(g + off + i);
            if (grad_y) _mm256_storeu_ps(grad_y + off + i, _mm256_div_ps(vg, vf));
            if (t) {
                __m256 q = _mm256_div_ps(_mm256_div_ps(_mm256_loadu_ps(y + off + i), vf), vf);
                _mm256_storeu_ps(t + off + i, _mm256_mul_ps(_mm256_xor_ps(vg, sign), q));
            }
        }
#endif
        for (; i < inner; ++i) {
            float gv = g[off + i];
            if (grad_y) grad_y[off + i] = gv / fr;
            if (t) t[off + i] = (-gv) * ((y[off + i] / fr) / fr);
        }
    }
}

// ---- f = gamma / sqrt(running_var + eps) of QConvBn2d (dal.formats.fold_factor) -------------
// Each float32 operation correctly rounded (IEEE add, sqrt, division; torch's own CPU sqrt is not
// always): std = sqrt(var + (float)eps), raw = gamma / std (gamma null: 1 / std); with ones_for_zero,
// f = raw where raw != 0, else 1 (training: a zero-gamma channel, dal.nn.conv_bn); keep[c] records
// raw != 0 for the backward. Scalar code: a few hundred channels, no vector win.
void dal_fold_factor(const float* gamma, const float* var, float eps, int64_t n, int ones_for_zero, float* f,
                     float* std_out, uint8_t* keep) {
    for (int64_t c = 0; c < n; ++c) {
        const float sd = std::sqrt(var[c] + eps);
        const float raw = (gamma ? gamma[c] : 1.0f) / sd;
        std_out[c] = sd;
        keep[c] = !ones_for_zero || raw != 0.0f;
        f[c] = keep[c] ? raw : 1.0f;
    }
}

// d gamma of the above, autograd's chain: where's backward (+0 where raw was replaced), then / std.
void dal_fold_factor_backward(const float* g, const float* std_in, const uint8_t* keep, int64_t n, float* grad) {
    for (int64_t c = 0; c < n; ++c) grad[c] = (keep[c] ? g[c] : 0.0f) / std_in[c];
}

}  // extern "C"

// ---- the FP16 / BF16 cast round trip of an FP16 island (dal.formats.fp_cast) ---------------
// out = float32(half(x)): each value rounded to the nearest float16 (dtype 0) or bfloat16
// (dtype 1), ties to even, overflow to +-inf, NaN stays NaN (payload not kept), subnormals of
// the narrow format kept (no flush), like torch's x.to(float16 / bfloat16).to(float32).
// F16C's vcvtps2ph with imm8 = round to nearest is exactly that conversion for float16.

namespace {

// float16: the grid near t has spacing q = 2^(max(e, emin) - 10), emin = 2^-14. Scaling by the
// exact power of two 1/q, rounding to an integer (ties to even) and scaling back is exact, so
// this is RNE on the float16 grid, subnormals included; past 65504 the result is +-inf.
inline float round_fp16_scalar(float t) {
    uint32_t e = (float_to_bits(t) >> 23) & 0xff;
    if (e == 0xff) return t;  // inf stays inf, NaN stays NaN
    int eq = (int)(e > 127 - 14 ? e : 127 - 14) - 10;
    float q = bits_to_float((uint32_t)eq << 23);
    float inv_q = bits_to_float((uint32_t)(254 - eq) << 23);
    float r = std::nearbyint(t * inv_q) * q;
    return std::fabs(r) > 65504.0f ? std::copysign(INFINITY, t) : r;
}

// bfloat16: the upper 16 bits of the float32, rounded to nearest even on the lower 16 (a carry
// into the exponent is the correct next value, up to +-inf). NaN is made quiet in the upper half.
inline uint32_t bf16_bits(uint32_t b) {
    if ((b & 0x7fffffffu) > 0x7f800000u) return (b | 0x00400000u) & 0xffff0000u;
    return (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
}

void cast_span(const float* x, float* out, int64_t n, int dtype) {
    int64_t i = 0;
    if (dtype == 0) {
#if defined(__AVX2__) && defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
        for (; i < n; ++i) out[i] = round_fp16_scalar(x[i]);
        return;
    }
#ifdef __AVX2__
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x00400000), hi16 = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    for (; i + 8 <= n; i += 8) {
        __m256i b = _mm256_loadu_si256((const __m256i*)(x + i));
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, half), _mm256_and_si256(_mm256_srli_epi32(b, 16), one));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, abs_mask), inf);  // signed compare: |b| < 2^31
        r = _mm256_blendv_epi8(r, _mm256_or_si256(b, quiet), nan);
        _mm256_storeu_si256((__m256i*)(out + i), _mm256_and_si256(r, hi16));
    }
#endif
    for (; i < n; ++i) out[i] = bits_to_float(bf16_bits(float_to_bits(x[i])));
}

}  // namespace

extern "C" {

// x, out: n contiguous float32 (out may be x); dtype 0: float16, 1: bfloat16. Chunks of kChunk
// elements over the threads (each element is independent: any split gives the same bits).
void dal_fp_cast_round_trip(const float* x, float* out, int64_t n, int dtype, int nthreads) {
    const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 4)
    for (int64_t k = 0; k < chunks; ++k) {
        int64_t begin = k * kChunk, len = begin + kChunk < n ? kChunk : n - begin;
        cast_span(x + begin, out + begin, len, dtype);
    }
}

int dal_fq_abi_version() { return 9; }

}  // extern "C"
