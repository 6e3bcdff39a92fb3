// Elementwise / pooling ops on integer codes (exact: see qconv.h and fused_ops.py).
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "qconv.h"

namespace dal_npu {

namespace {
template <typename F>
void in_codes(const torch::Tensor& x, const char* who, F&& f) {
  switch (x.scalar_type()) {
    case torch::kUInt8: f(x.data_ptr<uint8_t>()); break;
    case torch::kInt8: f(x.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, who, ": codes must be uint8 or int8");
  }
}

void check_lut(const torch::Tensor& lut, int64_t n, const char* who) {
  TORCH_CHECK(lut.dim() == 1 && lut.is_contiguous() && lut.size(0) == n &&
                  (lut.scalar_type() == torch::kUInt8 || lut.scalar_type() == torch::kInt8),
              who, ": lut must be a contiguous uint8/int8 vector of ", n, " entries");
}
}  // namespace

torch::Tensor maxpool_codes(const torch::Tensor& X, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                            int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW,
                            const torch::Tensor& lut, int64_t lut_base, int64_t nthreads) {
  TORCH_CHECK(X.dim() == 3 && X.is_contiguous(), "maxpool_codes: X must be contiguous codes [C, H, W]");
  TORCH_CHECK(kh >= 1 && kw >= 1 && sh >= 1 && sw >= 1 && dh >= 1 && dw >= 1 && pt >= 0 && pl >= 0 &&
                  kh < (1 << 16) && kw < (1 << 16) && sh < (1 << 16) && sw < (1 << 16) &&
                  dh < (1 << 16) && dw < (1 << 16) && pt < (1 << 16) && pl < (1 << 16),
              "maxpool_codes: bad geometry");
  TORCH_CHECK(OH >= 0 && OW >= 0 && OH < (1 << 24) && OW < (1 << 24), "maxpool_codes: bad output size");
  check_lut(lut, 256, "maxpool_codes");
  TORCH_CHECK(lut_base == 0 || lut_base == -128, "maxpool_codes: lut_base must be 0 or -128");
  const int64_t C = X.size(0), H = X.size(1), W = X.size(2);
  auto out = torch::empty({C, OH, OW}, torch::dtype(lut.scalar_type()));
  const uint8_t* tb = reinterpret_cast<const uint8_t*>(lut.data_ptr());
  uint8_t* o = reinterpret_cast<uint8_t*>(out.data_ptr());
  nthreads = std::max<int64_t>(1, nthreads);
  bool empty_window = false;
  // Separable and branch-free: each channel is copied into an int16 image bordered with a
  // sentinel below every code (-32768 acts as -inf), then a horizontal max over kw taps and a
  // vertical max over kh rows. A window that saw only padding keeps the sentinel.
  const int64_t Hp = std::max(pt + H, (OH - 1) * sh + (kh - 1) * dh + 1);
  const int64_t Wp = std::max(pl + W, (OW - 1) * sw + (kw - 1) * dw + 1);
  // (the caller falls back to the float path on any error, e.g. absurd pads or dilations)
  TORCH_CHECK(Hp * Wp < (int64_t(1) << 27), "maxpool_codes: padded image too large");
  in_codes(X, "maxpool_codes", [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
#pragma omp parallel num_threads(nthreads) reduction(|| : empty_window)
    {
      std::vector<int16_t> img(static_cast<size_t>(Hp * Wp)), hor(static_cast<size_t>(Hp * OW));
      std::vector<int16_t> col(static_cast<size_t>(OW));
#pragma omp for schedule(static)
      for (int64_t c = 0; c < C; ++c) {
        std::fill(img.begin(), img.end(), int16_t(-32768));
        const T* xc = x + c * H * W;
        for (int64_t y = 0; y < H; ++y) {
          int16_t* d = img.data() + (y + pt) * Wp + pl;
          for (int64_t xx = 0; xx < W; ++xx) d[xx] = xc[y * W + xx];
        }
        for (int64_t y = 0; y < Hp; ++y) {
          const int16_t* r = img.data() + y * Wp;
          int16_t* h = hor.data() + y * OW;
          for (int64_t ox = 0; ox < OW; ++ox) {
            int16_t m = r[ox * sw];
            for (int64_t j = 1; j < kw; ++j) m = std::max(m, r[ox * sw + j * dw]);
            h[ox] = m;
          }
        }
        for (int64_t oy = 0; oy < OH; ++oy) {
          const int16_t* h0 = hor.data() + oy * sh * OW;
          for (int64_t ox = 0; ox < OW; ++ox) col[ox] = h0[ox];
          for (int64_t i = 1; i < kh; ++i) {
            const int16_t* hi = h0 + i * dh * OW;
            for (int64_t ox = 0; ox < OW; ++ox) col[ox] = std::max(col[ox], hi[ox]);
          }
          uint8_t* orow = o + (c * OH + oy) * OW;
          for (int64_t ox = 0; ox < OW; ++ox) {
            const int32_t m = col[ox];
            if (m == -32768) empty_window = true;
            orow[ox] = tb[m == -32768 ? 0 : m - lut_base];
          }
        }
      }
    }
  });
  TORCH_CHECK(!empty_window, "maxpool_codes: a pooling window covers only padding");
  return out;
}

namespace {
// maxpool_codes_nhwc's loops, every parameter a local value (captured by reference, they were
// reloaded after every char store and nothing vectorized). True when a window saw only padding.
template <typename T>
bool pool_nhwc(const T* x, int64_t N, int64_t H, int64_t W, int64_t C, int64_t kh, int64_t kw, int64_t sh,
               int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW,
               const uint8_t* tb, int64_t lut_base, uint8_t* o, int64_t nthreads) {
  bool empty_window = false;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(|| : empty_window)
  for (int64_t r = 0; r < N * OH; ++r) {
    const int64_t n = r / OH, oy = r % OH;
    for (int64_t ox = 0; ox < OW; ++ox) {
      uint8_t* d = o + ((n * OH + oy) * OW + ox) * C;
      // blocks of 64 channels in a local array, so the max loop vectorizes
      for (int64_t c0 = 0; c0 < C; c0 += 64) {
        const int64_t cn = std::min<int64_t>(64, C - c0);
        T m[64];
        for (int c = 0; c < 64; ++c) m[c] = std::numeric_limits<T>::lowest();
        bool any = false;
        for (int64_t i = 0; i < kh; ++i) {
          const int64_t y = oy * sh - pt + i * dh;
          if (y < 0 || y >= H) continue;
          for (int64_t j = 0; j < kw; ++j) {
            const int64_t xx = ox * sw - pl + j * dw;
            if (xx < 0 || xx >= W) continue;
            const T* __restrict s = x + ((n * H + y) * W + xx) * C + c0;
            // by value, not std::max (its reference return defeated the vectorizer)
            if (cn == 64)
              for (int c = 0; c < 64; ++c) m[c] = s[c] > m[c] ? s[c] : m[c];
            else
              for (int64_t c = 0; c < cn; ++c) m[c] = s[c] > m[c] ? s[c] : m[c];
            any = true;
          }
        }
        if (!any) empty_window = true;
        for (int64_t c = 0; c < cn; ++c) d[c0 + c] = tb[int32_t(m[c]) - lut_base];
      }
    }
  }
  return empty_window;
}

// lut2_codes' loop with local parameters (through the lambda's references every char store
// forced them to be reloaded)
template <typename TA, typename TB>
void lut2(const TA* __restrict a, const TB* __restrict b, int64_t n, const uint8_t* __restrict tb,
          int64_t base_a, int64_t base_b, uint8_t* __restrict o, int64_t nthreads) {
  const int32_t off = static_cast<int32_t>(-base_a * 256 - base_b);
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t i = 0; i < n; ++i) o[i] = tb[int32_t(a[i]) * 256 + int32_t(b[i]) + off];
}
// gap_codes_mean's loops: pixel-major codes sum 64-channel blocks over the pixels (a task per
// image and block, each sum added in pixel order); NCHW codes one channel's pixels a task.
// out = float32(sum / double(HW)): the division in float64, one rounding (the node's
// GlobalAveragePool, export/SPEC.md §5a).
template <typename T>
void gap_mean(const T* x, int64_t N, int64_t C, int64_t HW, bool nhwc, const float* tb, float* out,
              int64_t nthreads) {
  const double count = static_cast<double>(HW);
  if (nhwc) {
    const int64_t nblk = (C + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t task = 0; task < N * nblk; ++task) {
      const int64_t n = task / nblk, c0 = task % nblk * 64, cn = std::min<int64_t>(64, C - c0);
      double acc[64] = {};
      const T* xn = x + n * HW * C + c0;
      for (int64_t p = 0; p < HW; ++p)
        for (int64_t c = 0; c < cn; ++c) acc[c] += double(tb[uint8_t(xn[p * C + c])]);
      for (int64_t c = 0; c < cn; ++c) out[n * C + c0 + c] = static_cast<float>(acc[c] / count);
    }
    return;
  }
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t nc = 0; nc < N * C; ++nc) {
    double acc = 0.0;
    const T* xc = x + nc * HW;
    for (int64_t p = 0; p < HW; ++p) acc += double(tb[uint8_t(xc[p])]);
    out[nc] = static_cast<float>(acc / count);
  }
}
}  // namespace

torch::Tensor gap_codes_mean(const torch::Tensor& X, const torch::Tensor& table, int64_t nhwc,
                             int64_t nthreads) {
  TORCH_CHECK(X.dim() == 4 && X.is_contiguous(), "gap_codes_mean: X must be contiguous 4-D codes");
  TORCH_CHECK(X.size(nhwc ? 1 : 2) * X.size(nhwc ? 2 : 3) < (int64_t(1) << 24),
              "gap_codes_mean: more than 2^24 pixels");
  TORCH_CHECK(table.dim() == 1 && table.is_contiguous() && table.size(0) == 256 &&
                  table.scalar_type() == torch::kFloat32,
              "gap_codes_mean: table must be a contiguous float32 vector of 256 entries");
  TORCH_CHECK(nhwc == 0 || nhwc == 1, "gap_codes_mean: nhwc must be 0 or 1");
  const int64_t N = X.size(0), C = X.size(nhwc ? 3 : 1), HW = X.size(nhwc ? 1 : 2) * X.size(nhwc ? 2 : 3);
  auto out = torch::empty({N, C, 1, 1}, torch::dtype(torch::kFloat32));
  const float* tb = table.data_ptr<float>();
  float* o = out.data_ptr<float>();
  nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024));
  in_codes(X, "gap_codes_mean", [&](auto* x) { gap_mean(x, N, C, HW, nhwc != 0, tb, o, nthreads); });
  return out;
}

// Pixel-major form: X [N, H, W, C] -> [N, OH, OW, C]; each output pixel is the channel-wise
// max of the valid window positions (padding ignored, as -inf), vectorizable over channels.
torch::Tensor maxpool_codes_nhwc(const torch::Tensor& X, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                 int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t OH, int64_t OW,
                                 const torch::Tensor& lut, int64_t lut_base, int64_t nthreads) {
  TORCH_CHECK(X.dim() == 4 && X.is_contiguous(), "maxpool_codes_nhwc: X must be contiguous codes [N, H, W, C]");
  TORCH_CHECK(kh >= 1 && kw >= 1 && sh >= 1 && sw >= 1 && dh >= 1 && dw >= 1 && pt >= 0 && pl >= 0 &&
                  kh < (1 << 16) && kw < (1 << 16) && sh < (1 << 16) && sw < (1 << 16) &&
                  dh < (1 << 16) && dw < (1 << 16) && pt < (1 << 16) && pl < (1 << 16),
              "maxpool_codes_nhwc: bad geometry");
  TORCH_CHECK(OH >= 0 && OW >= 0 && OH < (1 << 24) && OW < (1 << 24), "maxpool_codes_nhwc: bad output size");
  check_lut(lut, 256, "maxpool_codes_nhwc");
  TORCH_CHECK(lut_base == 0 || lut_base == -128, "maxpool_codes_nhwc: lut_base must be 0 or -128");
  const int64_t N = X.size(0), H = X.size(1), W = X.size(2), C = X.size(3);
  auto out = torch::empty({N, OH, OW, C}, torch::dtype(lut.scalar_type()));
  const uint8_t* tb = reinterpret_cast<const uint8_t*>(lut.data_ptr());
  uint8_t* o = reinterpret_cast<uint8_t*>(out.data_ptr());
  nthreads = std::max<int64_t>(1, nthreads);
  bool empty_window = false;
  in_codes(X, "maxpool_codes_nhwc", [&](auto* x) {
    empty_window = pool_nhwc(x, N, H, W, C, kh, kw, sh, sw, dh, dw, pt, pl, OH, OW, tb, lut_base, o, nthreads);
  });
  TORCH_CHECK(!empty_window, "maxpool_codes: a pooling window covers only padding");
  return out;
}

torch::Tensor lut2_codes(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& lut,
                         int64_t base_a, int64_t base_b, int64_t nb, int64_t nthreads) {
  TORCH_CHECK(A.is_contiguous() && B.is_contiguous() && A.sizes() == B.sizes(),
              "lut2_codes: A and B must be contiguous with one shape");
  TORCH_CHECK(nb == 256 && (base_a == 0 || base_a == -128) && (base_b == 0 || base_b == -128),
              "lut2_codes: 8-bit codes only");
  check_lut(lut, 256 * 256, "lut2_codes");
  auto out = torch::empty(A.sizes(), torch::dtype(lut.scalar_type()));
  const uint8_t* tb = reinterpret_cast<const uint8_t*>(lut.data_ptr());
  uint8_t* o = reinterpret_cast<uint8_t*>(out.data_ptr());
  const int64_t n = A.numel();
  nthreads = std::max<int64_t>(1, nthreads);
  in_codes(A, "lut2_codes", [&](auto* a) {
    in_codes(B, "lut2_codes", [&](auto* b) { lut2(a, b, n, tb, base_a, base_b, o, nthreads); });
  });
  return out;
}

}  // namespace dal_npu
