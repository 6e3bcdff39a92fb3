// im2col and depthwise convolution on zero-point-subtracted int16 activations (exact int32).
#include <algorithm>
#include <limits>

#include "gemm_s16.h"

namespace dal_npu {

namespace {
void check_geometry(const char* who, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh,
                    int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW) {
  TORCH_CHECK(kh >= 1 && kw >= 1 && kh <= 4096 && kw <= 4096, who, ": bad kernel size ", kh, "x", kw);
  TORCH_CHECK(sh >= 1 && sw >= 1 && dh >= 1 && dw >= 1, who, ": strides and dilations must be >= 1");
  TORCH_CHECK(pt >= 0 && pl >= 0 && pt < (1 << 24) && pl < (1 << 24), who, ": bad pads ", pt, ",", pl);
  TORCH_CHECK(OH >= 0 && OW >= 0 && OH < (1 << 24) && OW < (1 << 24), who, ": bad output size ", OH, "x", OW);
}
}  // namespace

torch::Tensor im2col_s16(const torch::Tensor& X, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                         int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW,
                         bool paired, int64_t nthreads) {
  TORCH_CHECK(X.dim() == 3 && X.scalar_type() == torch::kInt16 && X.is_contiguous(),
              "im2col_s16: X must be contiguous int16 [C, H, W]");
  check_geometry("im2col_s16", kh, kw, sh, sw, dh, dw, pt, pl, OH, OW);
  const int64_t C = X.size(0), H = X.size(1), W = X.size(2);
  const int64_t K = C * kh * kw, P = OH * OW, Np = (P + 15) / 16 * 16, K2 = (K + 1) / 2;
  TORCH_CHECK(K2 * 2 * Np < (int64_t(1) << 34), "im2col_s16: column buffer too large (K=", K, ", P=", P, ")");
  nthreads = std::max<int64_t>(1, nthreads);
  auto out = paired ? torch::zeros({K2, Np, 2}, torch::dtype(torch::kInt16))
                    : torch::zeros({K, Np}, torch::dtype(torch::kInt16));
  const int16_t* x = X.data_ptr<int16_t>();
  int16_t* o = out.data_ptr<int16_t>();
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t k = 0; k < K; ++k) {
    const int64_t c = k / (kh * kw), i = (k / kw) % kh, j = k % kw;
    // paired layout: element (k, p) lives at [k/2][p][k%2]; plain: [k][p]
    int16_t* row = paired ? o + (k / 2) * Np * 2 + (k & 1) : o + k * Np;
    const int64_t step = paired ? 2 : 1;
    // valid ox range: 0 <= ox*sw - pl + j*dw < W
    const int64_t off = j * dw - pl;
    int64_t ox_lo = off >= 0 ? 0 : (-off + sw - 1) / sw;
    int64_t ox_hi = off >= W ? 0 : (W - 1 - off) / sw + 1;  // exclusive
    ox_hi = std::min(ox_hi, OW);
    for (int64_t oy = 0; oy < OH; ++oy) {
      const int64_t iy = oy * sh - pt + i * dh;
      if (iy < 0 || iy >= H) continue;  // padding rows stay 0
      const int16_t* src = x + (c * H + iy) * W;
      int16_t* dst = row + oy * OW * step;
      for (int64_t ox = ox_lo; ox < ox_hi; ++ox) dst[ox * step] = src[ox * sw + off];
    }
  }
  return out;
}

torch::Tensor dwconv_s16(const torch::Tensor& X, const torch::Tensor& Wt, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl,
                         int64_t OH, int64_t OW, int64_t nthreads) {
  TORCH_CHECK(X.dim() == 3 && X.scalar_type() == torch::kInt16 && X.is_contiguous(),
              "dwconv_s16: X must be contiguous int16 [C, H, W]");
  check_geometry("dwconv_s16", kh, kw, sh, sw, dh, dw, pt, pl, OH, OW);
  TORCH_CHECK(Wt.dim() == 2 && Wt.scalar_type() == torch::kInt16 && Wt.is_contiguous() &&
                  Wt.size(0) == X.size(0) && Wt.size(1) == kh * kw,
              "dwconv_s16: Wt must be contiguous int16 [C, kh*kw]");
  const int64_t C = X.size(0), H = X.size(1), W = X.size(2);
  TORCH_CHECK(C * OH * OW < (int64_t(1) << 34), "dwconv_s16: output too large");
  nthreads = std::max<int64_t>(1, nthreads);
  auto out = torch::zeros({C, OH, OW}, torch::dtype(torch::kInt32));
  const int16_t* x = X.data_ptr<int16_t>();
  const int16_t* w = Wt.data_ptr<int16_t>();
  int32_t* o = out.data_ptr<int32_t>();
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t i = 0; i < kh; ++i) {
      for (int64_t j = 0; j < kw; ++j) {
        const int32_t wv = w[c * kh * kw + i * kw + j];
        if (wv == 0) continue;
        const int64_t off = j * dw - pl;
        int64_t ox_lo = off >= 0 ? 0 : (-off + sw - 1) / sw;
        int64_t ox_hi = off >= W ? 0 : (W - 1 - off) / sw + 1;
        ox_hi = std::min(ox_hi, OW);
        for (int64_t oy = 0; oy < OH; ++oy) {
          const int64_t iy = oy * sh - pt + i * dh;
          if (iy < 0 || iy >= H) continue;
          const int16_t* src = x + (c * H + iy) * W + off;
          int32_t* dst = o + (c * OH + oy) * OW;
          if (sw == 1) {
            for (int64_t ox = ox_lo; ox < ox_hi; ++ox) dst[ox] += wv * int32_t(src[ox]);
          } else {
            for (int64_t ox = ox_lo; ox < ox_hi; ++ox) dst[ox] += wv * int32_t(src[ox * sw]);
          }
        }
      }
    }
  }
  return out;
}

}  // namespace dal_npu
