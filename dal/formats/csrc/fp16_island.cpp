// A fused FP16 island (dal.formats.island): y = h16(act(h16(x))) in one pass forward and
// d act(h16(x)) / dx in one pass backward, h16(t) = float32(float16(t)).
//
// What it replaces, op by op (dal.prepare.fp16_island): the island's input FP16 round trip,
// torch's float32 activation on it, and the output round trip. The bits are those ops':
//   h16:         F16C vcvtps2ph (round to nearest, ties to even) then vcvtph2ps, as torch's cast
//   hardswish:   a = h * min(max(h + 3, 0), 6) / 6        (torch's CPU kernel, each op rounded)
//   hardsigmoid: a = min(max(h + 3, 0), 6) / 6
//   backward, with h = h16(x) and the incoming gradient g (both casts pass it through):
//   hardswish:   h <= -3: +0;  h < 3: g * (h / 3 + 0.5);  else g
//   hardsigmoid: -3 < h < 3: g * float(1/6);  else +0
// Built with -ffp-contract=off (no FMA), so every product and sum rounds once, as in torch.
//
// NaN or +-inf in h16(x) (|x| >= 65520 or NaN) makes the forward return 0: the caller then runs
// the ops one by one. There torch's own kernels differ between their vector body and scalar tail
// (hardswish's backward gives NaN for a NaN input in the body and g in the tail), and NaN
// payloads are not kept by every cast, so only torch can give torch's bits.
//
// Without AVX2 + F16C the entry points return 0 / do nothing: the caller takes torch's path.
#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kChunk = 16384;  // elements per work item (each element is independent)

#if defined(__AVX2__) && defined(__F16C__)
#define DAL_ISLAND_KERNEL 1

inline __m256 h16(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }

// y = h16(act(h16(x))) for 8 values; *bad |= lanes where h16(x) is NaN or +-inf.
inline __m256 forward8(__m256 v, int op, __m256* bad) {
    const __m256 three = _mm256_set1_ps(3.0f), zero = _mm256_setzero_ps(), six = _mm256_set1_ps(6.0f);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
    __m256 h = h16(v);
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(_mm256_and_ps(h, abs_mask), inf, _CMP_NLT_UQ));
    __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(h, three), zero), six);
    __m256 a = op == 0 ? _mm256_div_ps(_mm256_mul_ps(h, t), six) : _mm256_div_ps(t, six);
    return h16(a);
}

inline __m256 backward8(__m256 g, __m256 v, int op) {
    const __m256 three = _mm256_set1_ps(3.0f), neg_three = _mm256_set1_ps(-3.0f), zero = _mm256_setzero_ps();
    __m256 h = h16(v);
    if (op == 0) {
        __m256 r = _mm256_mul_ps(g, _mm256_add_ps(_mm256_div_ps(h, three), _mm256_set1_ps(0.5f)));
        r = _mm256_blendv_ps(r, g, _mm256_cmp_ps(h, three, _CMP_GE_OQ));
        return _mm256_blendv_ps(r, zero, _mm256_cmp_ps(h, neg_three, _CMP_LE_OQ));
    }
    __m256 inside = _mm256_and_ps(_mm256_cmp_ps(h, neg_three, _CMP_GT_OQ), _mm256_cmp_ps(h, three, _CMP_LT_OQ));
    return _mm256_blendv_ps(zero, _mm256_mul_ps(g, _mm256_set1_ps(1.0f / 6.0f)), inside);
}

// One span; the tail (< 8 values) goes through the same vector code on a zero-padded copy.
bool forward_span(const float* x, float* y, int64_t n, int op) {
    __m256 bad = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, forward8(_mm256_loadu_ps(x + i), op, &bad));
    if (i < n) {
        float in[8] = {0, 0, 0, 0, 0, 0, 0, 0}, out[8];
        std::memcpy(in, x + i, (n - i) * sizeof(float));
        _mm256_storeu_ps(out, forward8(_mm256_loadu_ps(in), op, &bad));
        std::memcpy(y + i, out, (n - i) * sizeof(float));
    }
    return _mm256_movemask_ps(bad) == 0;
}

void backward_span(const float* g, const float* x, float* gx, int64_t n, int op) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(gx + i, backward8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(x + i), op));
    if (i < n) {
        float gi[8] = {0, 0, 0, 0, 0, 0, 0, 0}, xi[8] = {0, 0, 0, 0, 0, 0, 0, 0}, out[8];
        std::memcpy(gi, g + i, (n - i) * sizeof(float));
        std::memcpy(xi, x + i, (n - i) * sizeof(float));
        _mm256_storeu_ps(out, backward8(_mm256_loadu_ps(gi), _mm256_loadu_ps(xi), op));
        std::memcpy(gx + i, out, (n - i) * sizeof(float));
    }
}
#endif

}  // namespace

extern "C" {

int dal_island_abi_version() { return 1; }

// Whether this build has the kernel (AVX2 and F16C at compile time).
int dal_island_available() {
#ifdef DAL_ISLAND_KERNEL
    return 1;
#else
    return 0;
#endif
}

// x, y: n contiguous float32; op 0: hardswish, 1: hardsigmoid. Returns 1, or 0 when h16(x) holds
// a NaN or an infinity (y is then unspecified) or the kernel is not built.
int dal_island_forward(const float* x, float* y, int64_t n, int op, int nthreads) {
#ifdef DAL_ISLAND_KERNEL
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    int ok = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(&& : ok) if (nthreads > 1 && chunks > 4)
    for (int64_t k = 0; k < chunks; ++k) {
        int64_t begin = k * kChunk, len = begin + kChunk < n ? kChunk : n - begin;
        ok = forward_span(x + begin, y + begin, len, op) && ok;
    }
    return ok;
#else
    (void)x; (void)y; (void)n; (void)op; (void)nthreads;
    return 0;
#endif
}

// g, x, gx: n contiguous float32 (x: the island's input, as the forward read it).
void dal_island_backward(const float* g, const float* x, float* gx, int64_t n, int op, int nthreads) {
#ifdef DAL_ISLAND_KERNEL
    const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 4)
    for (int64_t k = 0; k < chunks; ++k) {
        int64_t begin = k * kChunk, len = begin + kChunk < n ? kChunk : n - begin;
        backward_span(g + begin, x + begin, gx + begin, len, op);
    }
#else
    (void)g; (void)x; (void)gx; (void)n; (void)op; (void)nthreads;
#endif
}

}  // extern "C"
