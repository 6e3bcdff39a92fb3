// One call per integer group: codes in -> codes out (see qconv.h for the contract).
//
// Weights are packed once at load as panels of 16 output channels (zero point already
// subtracted), so a micro kernel streams one contiguous block per panel. Activations are
// turned once per call into a bordered HWC image (the border holds the zero point, i.e.
// contributes exactly 0): a pixel's patch for tap (i, j) is then C contiguous values, so the
// GEMM reads the image in place ("implicit GEMM": no im2col buffer) for any stride and
// dilation. Inputs with few channels (the first conv) get an explicit [P][K] patch matrix
// instead (short inner loops would dominate). A batch of N images is one call: the rows of all
// images form one pixel list.
//
// Threads: the work is cut into tasks (a block of pixels x a range of channel panels); each
// output is computed by exactly one task with a fixed summation order, so the result is
// identical for any thread count. Kernel variant: the ``isa`` argument (isa.h), checked
// against the CPU before anything runs.
#include "qconv.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "qconv_amx.h"
#include "qconv_micro.h"
#include "qconv_requant.h"

namespace dal_npu {

namespace {

using micro::TC;
using micro::TR;
using rq::Requant;

Requant make_requant(int64_t O, const torch::Tensor& mult, const torch::Tensor& bias_q,
                     const torch::Tensor& bias_f, const torch::Tensor& fp_m, const torch::Tensor& fp_n,
                     int64_t rounding, double ys, int64_t zy, int64_t lo, int64_t hi) {
  Requant q;
  q.O = O;
  q.Op = (O + TC - 1) / TC * TC;
  auto chk = [&](const torch::Tensor& t, torch::ScalarType st, const char* what, bool opt) {
    if (opt && t.numel() == 0) return false;
    TORCH_CHECK(t.dim() == 1 && t.scalar_type() == st && t.is_contiguous() && t.size(0) == q.Op,
                "qconv: ", what, " must be a contiguous 1-D tensor of ", q.Op, " elements");
    return true;
  };
  chk(mult, torch::kFloat64, "mult", false);
  q.mult = mult.data_ptr<double>();
  if (chk(bias_q, torch::kInt32, "bias_q", true)) q.bias_q = bias_q.data_ptr<int32_t>();
  if (chk(bias_f, torch::kFloat32, "bias_f", true)) q.bias_f = bias_f.data_ptr<float>();
  if (chk(fp_m, torch::kInt64, "fp_m", true)) {
    chk(fp_n, torch::kInt64, "fp_n", false);
    q.fp_m = fp_m.data_ptr<int64_t>();
    q.fp_n = fp_n.data_ptr<int64_t>();
    for (int64_t c = 0; c < O; ++c) {
      TORCH_CHECK(q.fp_m[c] >= 0 && q.fp_m[c] < (int64_t(1) << 62), "qconv: multiplier out of range");
      TORCH_CHECK(q.fp_n[c] >= -62 && q.fp_n[c] <= 100, "qconv: shift out of range");
    }
  }
  TORCH_CHECK(rounding >= 0 && rounding <= 2, "qconv: rounding must be 0, 1 or 2");
  TORCH_CHECK(lo <= hi && lo >= -(int64_t(1) << 31) && hi < (int64_t(1) << 31), "qconv: bad output range");
  TORCH_CHECK(zy >= -(int64_t(1) << 24) && zy <= (int64_t(1) << 24), "qconv: bad zero point");
  TORCH_CHECK(std::isfinite(ys) && ys > 0, "qconv: the output scale must be finite and > 0");
  q.rounding = static_cast<int>(rounding);
  q.ys = static_cast<float>(ys);
  q.zy = static_cast<int32_t>(zy);
  q.lo = static_cast<int32_t>(lo);
  q.hi = static_cast<int32_t>(hi);
  return q;
}

// Where pixel gp's codes go: conv output [N][O][P] (channel stride P), gemm output [M][O].
struct OutLayout {
  int64_t P = 0;  // pixels per image; 0 = gemm (row-major [M][O])
  int64_t O = 0;
  int64_t offset(int64_t gp) const { return P ? (gp / P) * O * P + gp % P : gp * O; }
  int64_t stride() const { return P ? P : 1; }
};

// A chunk of the reduction: taps [t0, t0 + ntaps) of toff, or for a single tap the k steps
// [c0, c0 + ck) (folded into a tap offset); boff: where it starts in a panel.
struct KChunk {
  const int64_t* toff;
  int64_t ntaps, ck, boff;
};

// Reduction chunks of at most ~KC bytes of activations per pixel: the weight slice of one
// micro tile for one chunk (16 channels per panel x KC bytes) then stays in L1 while the pixel
// tiles of a block stream past it, and the block's activations (PB pixels x KC) stay in L2.
// KC = 2048 / (panels per micro tile): the slice is <= 32 KB whatever the tile width (36 KB for a
// whole reduction of at most 576 bytes on four-panel tiles: run_core).
template <int64_t KS, typename E>
std::vector<KChunk> k_chunks(const std::vector<int64_t>& toff, std::vector<int64_t>& single, int64_t CK,
                             int64_t KC) {
  const int64_t ntaps = static_cast<int64_t>(toff.size());
  const int64_t step_bytes = KS * static_cast<int64_t>(sizeof(E));  // bytes per k step of one pixel
  std::vector<KChunk> out;
  if (ntaps == 1) {
    const int64_t per = std::max<int64_t>(1, KC / step_bytes);
    single.clear();
    for (int64_t c0 = 0; c0 < CK; c0 += per) single.push_back(toff[0] + c0 * KS);
    for (int64_t i = 0, c0 = 0; c0 < CK; ++i, c0 += per)
      out.push_back({single.data() + i, 1, std::min(per, CK - c0), c0 * KS * micro::TC});
    return out;
  }
  const int64_t per = std::max<int64_t>(1, KC / std::max<int64_t>(1, CK * step_bytes));
  for (int64_t t0 = 0; t0 < ntaps; t0 += per)
    out.push_back({toff.data() + t0, std::min(per, ntaps - t0), CK, t0 * CK * KS * micro::TC});
  return out;
}

// amx_int8: one task's whole reduction on AMX tiles (qconv_amx.h): the task's pixel rows are
// copied into a contiguous [rows][Kpad] block, then 32 x 32 tiles sum every k step. Rows that
// already form a strided matrix the tiles can load whole (amx::in_place: one tap, K a
// multiple of 64 bytes, equally spaced rows, a multiple of 16 of them: GEMM rows, unpadded
// stride-1 1x1 convs) are read in place; ready: the rows already copied by run_core (shared by
// the channel ranges of a small layer), row stride lda. A no-op for int16 rows (the AMX variant
// runs int16 panels on the AVX2 kernels). done(r0, r1): rows [r0, r1) of acc are final (after
// each 32-pixel group, amx::gemm), under the caller's amx::TileScope.
template <typename E, typename WT, typename Done>
void amx_task(const E* const* rp, int64_t pn, const std::vector<int64_t>& toff, int64_t CK, const WT* B,
              int64_t panel_size, int64_t npan, const int8_t* tail, int32_t* acc, int64_t ldc,
              const uint8_t* ready, int64_t lda, Done&& done) {
  if constexpr (std::is_same_v<E, uint8_t>) {
    const int64_t ntaps = static_cast<int64_t>(toff.size()), K4 = ntaps * CK, Kpad = (K4 * 4 + 63) / 64 * 64;
    if (ready) {
      amx::gemm(ready, pn, lda, B, panel_size, npan, K4, tail, acc, ldc, done);
      return;
    }
    if (amx::in_place(rp, pn, ntaps, K4, toff[0])) {
      amx::gemm(rp[0] + toff[0], pn, pn > 1 ? rp[1] - rp[0] : Kpad, B, panel_size, npan, K4, tail, acc, ldc, done);
      return;
    }
    thread_local amx::Aligned<uint8_t> a;
    uint8_t* ab = a.get(static_cast<size_t>((pn + 15) / 16 * 16 * Kpad));
    amx::pack_a(rp, pn, toff.data(), ntaps, CK, ab, Kpad);
    amx::gemm(ab, pn, Kpad, B, panel_size, npan, K4, tail, acc, ldc, done);
  }
}

// How run_core cuts its work: nblocks pixel blocks (block b: tiles [b * ntiles / nblocks,
// (b + 1) * ntiles / nblocks) of tr pixels, so blocks differ by one tile at most) x nchunks
// channel ranges of per panels. With several threads the blocks come in a multiple of the
// thread count, so that each thread gets an equal share at batch 1 too; a layer with too few
// pixel tiles for that (7x7 and 14x14 maps) splits its channels instead, each thread then
// reading one shared copy of the rows (amx_int8 with 3 or more threads: run_core) instead of
// copying them again per range.
// So does a layer with at least twice as many output channels as pixels (ResNet's 7x7 maps
// at batch 1, a GEMM's few rows): its packed weights (Op x K) outweigh its rows (P x K), and a pixel
// split had every thread stream all of them (2.4 MB per 3x3 conv of layer4, beyond one core's
// L2), a channel split each thread its own share. The result never depends on the partition:
// each output is one exact int32 sum.
struct Plan {
  int64_t tr, ntiles, nblocks, nchunks, per;
  int64_t block_begin(int64_t b) const { return b * ntiles / nblocks * tr; }
};

Plan make_plan(int64_t P, int64_t npanels, int64_t wmax, int64_t nthreads, bool amx) {
  Plan pl;
  pl.tr = amx ? 32 : TR;
  const int64_t tiles_max = amx ? 6 : 32;  // ~192 pixels a block: PB x KC bytes stays in L2
  pl.ntiles = (P + pl.tr - 1) / pl.tr;
  const int64_t nb0 = std::max<int64_t>(1, (pl.ntiles + tiles_max - 1) / tiles_max);
  pl.nblocks = nb0;
  pl.nchunks = 1;
  if (nthreads > 1) {
    const int64_t nb = std::min(pl.ntiles, (nb0 + nthreads - 1) / nthreads * nthreads);
    // an equal share against the busiest thread's tiles, thread t taking blocks
    // [t * nb / n, (t + 1) * nb / n) (run_core's static schedule)
    int64_t busiest = 1;
    for (int64_t t = 0; t < nthreads; ++t) {
      const int64_t b0 = t * nb / nthreads, b1 = (t + 1) * nb / nthreads;
      busiest = std::max(busiest, b1 * pl.ntiles / nb - b0 * pl.ntiles / nb);
    }
    const double eff = double(pl.ntiles) / nthreads / double(busiest);
    const bool weight_bound = npanels * TC >= 2 * P;  // weights (Op x K) twice the rows (P x K)
    if ((eff >= 0.85 && !weight_bound) || npanels < 2 * nthreads * wmax) {
      pl.nblocks = nb;
    } else {
      while (pl.nchunks < nthreads && npanels >= 2 * pl.nchunks * wmax) pl.nchunks *= 2;
    }
  }
  const int64_t per_chunk = (npanels + pl.nchunks - 1) / pl.nchunks;
  pl.per = (per_chunk + wmax - 1) / wmax * wmax;  // whole widest tiles
  return pl;
}

// GEMM over pixel rows (row pointers + tap offsets) against packed panels, requantized per
// task while the accumulators are still in cache. ONE OpenMP parallel region per call: pre()
// runs first inside it (the caller's image copy: an orphaned "omp for", whose barrier ends
// it), then (amx_int8 with split channels) the shared row copy, then the tasks.
// E: row element (int16 pairs / uint8 quads), WT: packed weight element; one k step covers
// KS = 4 / sizeof(E) reduction indices, a panel is K2 * KS * TC weights.
template <typename T, typename E, typename WT, typename Pre>
bool run_core(const std::vector<const E*>& rows, const std::vector<int64_t>& toff, int64_t CK,
              const WT* Bp, const Requant& q, T* out, OutLayout lay, int32_t* acc_out,
              int64_t nthreads, const micro::Kernels<E, WT>& kern, int isa, Pre&& pre) {
  constexpr int64_t KS = 4 / sizeof(E);
  const int64_t P = static_cast<int64_t>(rows.size());
  const int64_t ntaps = static_cast<int64_t>(toff.size()), K2 = ntaps * CK;
  const int64_t panel_size = K2 * KS * TC;
  const int64_t npanels = q.Op / TC;
  std::vector<int64_t> single;
  const int64_t wmax = kern.widest();  // panels per widest micro tile (1, 2 or 4)
  // zmm four-panel tiles: a reduction of at most 576 bytes (3x3 x 64 channels) is one chunk (a
  // 36 KB slice) instead of 384 + 192 bytes, whose second kernel call per tile (its reload of the
  // accumulators, its loop exits) cost more than the larger slice: 367 -> 358 us at 64x64, 56x56
  const int64_t red_bytes = K2 * KS * static_cast<int64_t>(sizeof(E));
  const int64_t kc_bytes = wmax == 4 && red_bytes <= 2304 / wmax ? 2304 / wmax : 2048 / wmax;
  const std::vector<KChunk> chunks = k_chunks<KS, E>(toff, single, CK, kc_bytes);
  // amx_int8: 32-pixel tiles, the whole reduction in one kernel call (no chunks); the K tail of
  // every panel (K2 % 16 quads) copied once, zero padded, so no tile load reads past a panel.
  // Many short taps (the 7x7 conv on 3 channels: 7 taps of 28 bytes) stay on the zmm kernels,
  // which read them in place: there, copying the rows for the tiles cost more than AMX saved
  // (measured: 0.78 against 0.72 ms for ResNet-18's first conv).
  const bool amx = sizeof(E) == 1 && isa == kAmxInt8 && (ntaps == 1 || CK * KS >= 64);
  // (line aligned, as the panels are: kernels.py packs them into torch's 64-byte aligned memory)
  amx::Aligned<int8_t> btail_buf;
  const int8_t* btail = nullptr;
  if constexpr (sizeof(E) == 1)
    if (amx && K2 % 16) {
      int8_t* t = btail_buf.get(static_cast<size_t>(npanels * 1024));
      amx::pack_b_tail(Bp, panel_size, npanels, K2, t);
      btail = t;
    }
  const Plan pl = make_plan(P, npanels, amx ? 2 : wmax, nthreads, amx);
  const int64_t ntasks = pl.nblocks * pl.nchunks;
  // split channels on AMX with 3 or more threads: the rows are copied once for all ranges
  // (amx::Rows), in parallel. With 2 threads each range copies all the rows itself (amx_task):
  // in a ResNet-18 run (weights cold, batch 1, u8 and s8) layer4's 3x3 convs took 7-19 us less
  // each that way (a shared copy costs a barrier, and each thread then reads half of the rows
  // from the other core's cache), while a 1-thread run never splits
  const bool shared_rows =
      amx && pl.nchunks > 1 && nthreads > 2 && !amx::in_place(rows.data(), P, ntaps, K2, toff[0]);
  amx::Rows shared;
  if (shared_rows) shared.reserve(P, K2);
  bool ovf = false;
#pragma omp parallel num_threads(nthreads) reduction(|| : ovf)
  {
    pre();
    if constexpr (sizeof(E) == 1) {
      if (shared_rows) {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (P + 15) / 16; ++g)
          shared.pack(reinterpret_cast<const uint8_t* const*>(rows.data()), P, g * 16, toff.data(), ntaps, CK);
      }
    }
    // task = channel range x block, channel-major: dealt statically (below), thread t takes
    // the t-th contiguous share -- its own channel range, or its own band of image rows, the
    // same band in every layer of one map size and the band that thread copied into the
    // bordered image, so its input codes are mostly in its own L2
    auto run_task = [&](int64_t task) {
      const int64_t ch = task / pl.nblocks, blk = task % pl.nblocks;
      const int64_t p0 = pl.block_begin(blk), pn = std::min<int64_t>(pl.block_begin(blk + 1), P) - p0;
      const int64_t g0 = ch * pl.per, g1 = std::min<int64_t>(npanels, g0 + pl.per);
      if (pn <= 0 || g0 >= g1) return;
      const int64_t width = (g1 - g0) * TC;
      thread_local amx::Aligned<int32_t> scratch;  // tile stores: whole lines (width % 16 == 0)
      int32_t* acc = scratch.get(static_cast<size_t>(pn * width));
      const Requant part = q.slice(g0 * TC, g1 * TC);
      const int64_t st = lay.stride();
      auto requant = [&](int64_t r0, int64_t r1) {  // rows [r0, r1) of the task's accumulators
        if (st == 1 && !acc_out && rq::block_ok<T>(part, isa)) {  // pixel-major codes: one pass
          ovf = rq::requant_block_avx512<T>(part, acc + r0 * width, r1 - r0, out + lay.offset(p0 + r0) + g0 * TC,
                                            lay.O) || ovf;
          return;
        }
        for (int64_t lp = r0; lp < r1; ++lp) {
          const int64_t at = lay.offset(p0 + lp) + g0 * TC * st;
          ovf = rq::requant_row<T>(part, acc + lp * width, out + at, st, acc_out ? acc_out + at : nullptr, st,
                                   isa) || ovf;
        }
      };
      // amx_int8: one kernel call per task, each 32-pixel group requantized right after its
      // tiles are stored, while its accumulators (32 x width int32) are still in L1 (weights too
      // large for L2, amx::groups_inside: all the task's groups at the end)
      if (amx) {
        const amx::TileScope tiles(true);  // the tile configuration, loaded once per task
        amx_task(rows.data() + p0, pn, toff, CK, Bp + g0 * panel_size, panel_size, g1 - g0,
                 btail ? btail + g0 * 1024 : nullptr, acc, width, shared_rows ? shared.at(p0) : nullptr,
                 shared.Kpad, requant);
      }
      for (size_t kc = 0; !amx && kc < chunks.size(); ++kc) {
        const KChunk& c = chunks[kc];
        for (int64_t pnl = g0; pnl < g1;) {
          const int64_t np = kern.four[1] && pnl + 4 <= g1 ? 4 : kern.two[1] && pnl + 2 <= g1 ? 2 : 1;
          const auto& fn = np == 4 ? kern.four : np == 2 ? kern.two : kern.one;
          const WT* B = Bp + pnl * panel_size + c.boff;
          // the next weight slice: the next panel group of this chunk, else the first of the
          // next chunk; tile i = 1..4 has the four-panel kernel prefetch its panel i - 1 into L2
          // (measured at 512 channels, 7x7: 290 -> 269 us; a burst of prefetches between the
          // calls instead stalled on the line fill buffers, 308 -> 388 us)
          const bool more = pnl + np < g1;
          const KChunk* cn = more ? &c : kc + 1 < chunks.size() ? &chunks[kc + 1] : nullptr;
          const int64_t nxt = more ? pnl + np : g0, npf = cn ? std::min<int64_t>(4, g1 - nxt) : 0;
          for (int64_t t0 = 0, i = 0; t0 < pn; t0 += TR, ++i) {
            const int r = static_cast<int>(std::min<int64_t>(TR, pn - t0));
            const WT* pf = i >= 1 && i <= npf ? Bp + (nxt + i - 1) * panel_size + cn->boff : nullptr;
            fn[r](rows.data() + p0 + t0, c.toff, c.ntaps, c.ck, B, panel_size,
                  acc + t0 * width + (pnl - g0) * TC, width, kc > 0, pf);
          }
          pnl += np;
        }
      }
      if (!amx) requant(0, pn);
    };
    if (ntasks % nthreads == 0) {  // equal shares (make_plan): static, no scheduling traffic
#pragma omp for schedule(static) nowait
      for (int64_t task = 0; task < ntasks; ++task) run_task(task);
    } else {
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t task = 0; task < ntasks; ++task) run_task(task);
    }
  }
  return ovf;
}

// to_hwc (below) from pixel-major codes [H][W][C] (layout bit 0): row copies, vectorizable.
template <typename S, typename T>
void nhwc_to_hwc(const T* x, int64_t C, int64_t H, int64_t W, int32_t zx, S* dst, int64_t Wp,
                 int64_t Cp, int64_t pt, int64_t pl, int64_t y0, int64_t y1) {
  for (int64_t y = y0; y < y1; ++y) {
    S* row = dst + ((y + pt) * Wp + pl) * Cp;
    const T* s = x + y * W * C;
    if (Cp == C) {
      for (int64_t i = 0; i < W * C; ++i) row[i] = static_cast<S>(int32_t(s[i]) - zx);
    } else {
      for (int64_t xx = 0; xx < W; ++xx)
        for (int64_t c = 0; c < C; ++c) row[xx * Cp + c] = static_cast<S>(int32_t(s[xx * C + c]) - zx);
    }
  }
}

// code minus zero point (int16 image, S = int16) or code minus base (uint8 image, S = uint8:
// zx is then the base, 0 for uint8 codes and -128 for int8 codes)
template <typename S, typename T>
void to_hwc(const T* x, int64_t C, int64_t H, int64_t W, int32_t zx, S* dst, int64_t Wp,
            int64_t Cp, int64_t pt, int64_t pl, int64_t y0, int64_t y1) {
  for (int64_t y = y0; y < y1; ++y) {
    S* row = dst + ((y + pt) * Wp + pl) * Cp;
    for (int64_t c = 0; c < C; ++c) {
      const T* s = x + (c * H + y) * W;
      for (int64_t xx = 0; xx < W; ++xx) row[xx * Cp + c] = static_cast<S>(int32_t(s[xx]) - zx);
    }
  }
}

// Packed weights: int16 [ceil(O/16), K/2, 16, 2] (vpmaddwd) or int8 [ceil(O/16), K/4, 16, 4]
// (vpdpbusd). Returns the number of reduction indices per k step (2 or 4).
int64_t check_b(const torch::Tensor& Bp, int64_t O) {
  const bool s8 = Bp.scalar_type() == torch::kInt8;
  TORCH_CHECK(Bp.dim() == 4 && (s8 || Bp.scalar_type() == torch::kInt16) && Bp.is_contiguous() &&
                  Bp.size(0) == (O + TC - 1) / TC && Bp.size(2) == TC && Bp.size(3) == (s8 ? 4 : 2),
              "qconv: packed weights must be contiguous int16 [ceil(O/16), K/2, 16, 2] or int8 "
              "[ceil(O/16), K/4, 16, 4]");
  return s8 ? 4 : 2;
}

torch::ScalarType out_type(int64_t code) {
  TORCH_CHECK(code >= 0 && code <= 2, "qconv: out dtype code must be 0 (int32), 1 (uint8), 2 (int8)");
  return code == 1 ? torch::kUInt8 : code == 2 ? torch::kInt8 : torch::kInt32;
}

template <typename F>
bool dispatch_out(torch::Tensor& out, F&& f) {
  switch (out.scalar_type()) {
    case torch::kUInt8: return f(out.data_ptr<uint8_t>());
    case torch::kInt8: return f(out.data_ptr<int8_t>());
    default: return f(out.data_ptr<int32_t>());
  }
}

template <typename F>
void dispatch_in(const torch::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case torch::kUInt8: f(x.data_ptr<uint8_t>()); break;
    case torch::kInt8: f(x.data_ptr<int8_t>()); break;
    case torch::kInt16: f(x.data_ptr<int16_t>()); break;
    default: TORCH_CHECK(false, "qconv: input codes must be uint8, int8 or int16");
  }
}

// VNNI offset: rows hold u = code - base in [0, 255]; padding holds uz = zx - base, so every
// position contributes (u - uz) * w and acc = sum u*w - uz * sum_k w[o, k] (corr, per channel).
struct Offset {
  int32_t base = 0, uz = 0;
  std::vector<int32_t> corr;
};

Offset make_offset(const torch::Tensor& X, int64_t zx, const torch::Tensor& wsum, int64_t Op) {
  Offset off;
  TORCH_CHECK(X.scalar_type() == torch::kUInt8 || X.scalar_type() == torch::kInt8,
              "qconv: int8 weight panels need uint8 or int8 input codes");
  off.base = X.scalar_type() == torch::kInt8 ? -128 : 0;
  off.uz = static_cast<int32_t>(zx - off.base);
  TORCH_CHECK(off.uz >= 0 && off.uz <= 255, "qconv: zero point outside the code range");
  TORCH_CHECK(wsum.dim() == 1 && wsum.scalar_type() == torch::kInt32 && wsum.is_contiguous() &&
                  wsum.size(0) == Op, "qconv: wsum must be contiguous int32 [", Op, "]");
  const int32_t* ws = wsum.data_ptr<int32_t>();
  off.corr.resize(Op);
  for (int64_t o = 0; o < Op; ++o) {
    const int64_t c = int64_t(off.uz) * ws[o];
    TORCH_CHECK(c >= INT32_MIN && c <= INT32_MAX, "qconv: reduction too long for the int8 path");
    off.corr[o] = static_cast<int32_t>(c);
  }
  return off;
}

template <typename S>
const auto& kernels_for(int isa) {
  if constexpr (sizeof(S) == 1) return micro::kernels_u8(isa);
  else return micro::kernels_s16(isa);
}

struct Geo {
  int64_t kh, kw, sh, sw, dh, dw, pt, pl, OH, OW;
};

// Layout bits of qconv: X pixel-major [N, H, W, C]; output (and acc_out) pixel-major [N, P, O].
constexpr int64_t kInNHWC = 1, kOutNHWC = 2;

template <typename S>
bool conv_impl(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
               const Geo& g, bool implicit, Requant& q, torch::Tensor& out, int32_t* ao,
               int64_t nthreads, int isa, int64_t layout) {
  constexpr int64_t KS = 4 / sizeof(S);
  const bool in_nhwc = layout & kInNHWC;
  const int64_t N = X.size(0), C = X.size(in_nhwc ? 3 : 1), H = X.size(in_nhwc ? 1 : 2),
                W = X.size(in_nhwc ? 2 : 3);
  // extent of the padded image the windows touch (may be less or more than H + pads)
  const int64_t Hp = std::max(g.pt + H, (g.OH - 1) * g.sh + (g.kh - 1) * g.dh + 1);
  const int64_t Wp = std::max(g.pl + W, (g.OW - 1) * g.sw + (g.kw - 1) * g.dw + 1);
  const int64_t Cp = implicit ? (C + KS - 1) / KS * KS : C;
  TORCH_CHECK(N * Hp * Wp * (Cp + 3) * int64_t(sizeof(S)) < (int64_t(1) << 31), "qconv: padded image too large");
  const int64_t P = g.OH * g.OW, taps = g.kh * g.kw, img_size = Hp * Wp * Cp;
  const int64_t K = implicit ? taps * Cp : (taps * C + KS - 1) / KS * KS;
  TORCH_CHECK(Bp.size(1) * KS == K, "qconv: packed weights hold ", Bp.size(1) * KS,
              " reduction indices, the geometry needs ", K);
  Offset off;
  int32_t fill = 0, sub = static_cast<int32_t>(zx);
  if constexpr (KS == 4) {
    off = make_offset(X, zx, wsum, q.Op);
    q.corr = off.corr.data();
    fill = off.uz;
    sub = off.base;
  }
  // pixel-major uint8 codes (base 0) whose windows never leave the image: read in place
  const bool direct = in_nhwc && implicit && KS == 4 && sub == 0 && Cp == C && g.pt == 0 &&
                      g.pl == 0 && Hp == H && Wp == W && X.scalar_type() == torch::kUInt8;
  // the bordered image, filled by copy_image inside run_core's parallel region (implicit) or
  // before the patch matrix (explicit): one padded row a step, border and channel pad = fill
  amx::Aligned<S> img_buf;  // line aligned: rows of a 1x1 conv may be tile rows in place
  S* img = direct ? nullptr : img_buf.get(static_cast<size_t>(N * img_size));
  const S* image = direct ? reinterpret_cast<const S*>(X.data_ptr()) : img;
  const S sfill = static_cast<S>(fill);
  auto copy_image = [&] {  // an orphaned "omp for": shared by the threads of the enclosing region
    if (direct) return;
    dispatch_in(X, [&](auto* x) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N * Hp; ++i) {
        const int64_t n = i / Hp, yp = i % Hp, y = yp - g.pt;
        S* d = img + n * img_size + yp * Wp * Cp;
        if (y < 0 || y >= H || Cp != C) {
          std::fill(d, d + Wp * Cp, sfill);
          if (y < 0 || y >= H) continue;
        } else {
          std::fill(d, d + g.pl * Cp, sfill);
          std::fill(d + (g.pl + W) * Cp, d + Wp * Cp, sfill);
        }
        S* im = img + n * img_size;
        if (in_nhwc) nhwc_to_hwc<S>(x + n * C * H * W, C, H, W, sub, im, Wp, Cp, g.pt, g.pl, y, y + 1);
        else to_hwc<S>(x + n * C * H * W, C, H, W, sub, im, Wp, Cp, g.pt, g.pl, y, y + 1);
      }
    });
  };
  std::vector<const S*> rows(N * P);
  std::vector<int64_t> toff;
  std::vector<S> cols;
  int64_t CK;
  if (implicit) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t oy = 0; oy < g.OH; ++oy)
        for (int64_t ox = 0; ox < g.OW; ++ox)
          rows[n * P + oy * g.OW + ox] = image + n * img_size + ((oy * g.sh) * Wp + ox * g.sw) * Cp;
    // dw == 1 and a short kernel row (few channels, e.g. the 7x7 first conv): the kw taps of a
    // kernel row are kw*Cp contiguous values of the image and kw*Cp contiguous reduction
    // indices of the panels, so they are one tap of kw*Cp/KS steps (fewer, longer inner loops)
    const int64_t kc_bytes = 2048 / kernels_for<S>(isa).widest();
    if (g.dw == 1 && g.kw > 1 && g.kw * Cp * int64_t(sizeof(S)) <= kc_bytes) {
      for (int64_t i = 0; i < g.kh; ++i) toff.push_back(i * g.dh * Wp * Cp);
      CK = g.kw * Cp / KS;
    } else {
      for (int64_t i = 0; i < g.kh; ++i)
        for (int64_t j = 0; j < g.kw; ++j) toff.push_back((i * g.dh * Wp + j * g.dw) * Cp);
      CK = Cp / KS;
    }
  } else {
    // explicit patch matrix [N*P][K], k = (i*kw + j)*C + c, zero padded (zero weights) to K
    TORCH_CHECK(N * P * K * int64_t(sizeof(S)) < (int64_t(1) << 31), "qconv: patch matrix too large");
#pragma omp parallel num_threads(nthreads)
    copy_image();
    cols.assign(static_cast<size_t>(N * P * K), static_cast<S>(fill));
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t gp = 0; gp < N * P; ++gp) {
      const int64_t n = gp / P, p = gp % P, oy = p / g.OW, ox = p % g.OW;
      S* d = cols.data() + gp * K;
      const S* base = img + n * img_size + ((oy * g.sh) * Wp + ox * g.sw) * Cp;
      for (int64_t i = 0; i < g.kh; ++i) {
        if (g.dw == 1) {  // the kw taps of a kernel row are kw*C contiguous values
          std::memcpy(d, base + i * g.dh * Wp * Cp, sizeof(S) * g.kw * C);
          d += g.kw * C;
        } else {
          for (int64_t j = 0; j < g.kw; ++j, d += C)
            std::memcpy(d, base + (i * g.dh * Wp + j * g.dw) * Cp, sizeof(S) * C);
        }
      }
    }
    for (int64_t gp = 0; gp < N * P; ++gp) rows[gp] = cols.data() + gp * K;
    toff.push_back(0);
    CK = K / KS;
  }
  using WT = std::conditional_t<sizeof(S) == 1, int8_t, int16_t>;
  return dispatch_out(out, [&](auto* o) {
    return run_core(rows, toff, CK, Bp.data_ptr<WT>(), q, o, OutLayout{layout & kOutNHWC ? 0 : P, q.O}, ao,
                    nthreads, kernels_for<S>(isa), isa, [&] {
                      if (implicit) copy_image();
                    });
  });
}

template <typename S>
bool gemm_impl(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
               Requant& q, torch::Tensor& out, int32_t* ao, int64_t nthreads, int isa) {
  constexpr int64_t KS = 4 / sizeof(S);
  const int64_t M = X.size(0), Kx = X.size(1), K = (Kx + KS - 1) / KS * KS;
  TORCH_CHECK(Bp.size(1) * KS == K, "qgemm: packed weights hold ", Bp.size(1) * KS,
              " reduction indices, X has ", Kx);
  TORCH_CHECK(M * K < (int64_t(1) << 31), "qgemm: input too large");
  Offset off;
  int32_t fill = 0, sub = static_cast<int32_t>(zx);
  if constexpr (KS == 4) {
    off = make_offset(X, zx, wsum, q.Op);
    q.corr = off.corr.data();
    fill = off.uz;
    sub = off.base;
  }
  // uint8 codes with K % 4 == 0 are already the rows vpdpbusd reads: no copy
  const bool direct = KS == 4 && sub == 0 && K == Kx && X.scalar_type() == torch::kUInt8;
  std::vector<S> a(direct ? 0 : static_cast<size_t>(M * K), static_cast<S>(fill));
  if (!direct)
    dispatch_in(X, [&](auto* x) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < Kx; ++k) a[m * K + k] = static_cast<S>(int32_t(x[m * Kx + k]) - sub);
    });
  const S* base = direct ? reinterpret_cast<const S*>(X.data_ptr()) : a.data();
  std::vector<const S*> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = base + m * K;
  if (M == 0) return false;
  using WT = std::conditional_t<sizeof(S) == 1, int8_t, int16_t>;
  return dispatch_out(out, [&](auto* o) {
    return run_core(rows, std::vector<int64_t>{0}, K / KS, Bp.data_ptr<WT>(), q, o, OutLayout{0, q.O}, ao,
                    nthreads, kernels_for<S>(isa), isa, [] {});
  });
}

int32_t* acc_out_ptr(const torch::Tensor& acc_out, int64_t numel, const char* who) {
  if (acc_out.numel() == 0) return nullptr;
  TORCH_CHECK(acc_out.scalar_type() == torch::kInt32 && acc_out.is_contiguous() && acc_out.numel() == numel,
              who, ": acc_out must be contiguous int32 with ", numel, " elements");
  return acc_out.data_ptr<int32_t>();
}

}  // namespace

torch::Tensor qconv(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
                    int64_t O, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                    int64_t pt, int64_t pl, int64_t OH, int64_t OW, bool implicit,
                    const torch::Tensor& mult, const torch::Tensor& bias_q, const torch::Tensor& bias_f,
                    const torch::Tensor& fp_m, const torch::Tensor& fp_n, int64_t rounding, double ys,
                    int64_t zy, int64_t lo, int64_t hi, int64_t out_code, const torch::Tensor& acc_out,
                    int64_t nthreads, int64_t isa, int64_t layout) {
  TORCH_CHECK((X.dim() == 3 || X.dim() == 4) && X.is_contiguous(),
              "qconv: X must be contiguous codes [C, H, W] or [N, C, H, W] ([H, W, C] / [N, H, W, C] pixel-major)");
  TORCH_CHECK(layout >= 0 && layout <= 3, "qconv: layout must be 0..3 (bit 0: X pixel-major, bit 1: output pixel-major)");
  TORCH_CHECK(kh >= 1 && kw >= 1 && kh <= 4096 && kw <= 4096, "qconv: bad kernel size");
  TORCH_CHECK(sh >= 1 && sw >= 1 && dh >= 1 && dw >= 1 && sh < (1 << 16) && sw < (1 << 16) &&
                  dh < (1 << 16) && dw < (1 << 16), "qconv: strides and dilations must be in [1, 65535]");
  TORCH_CHECK(pt >= 0 && pl >= 0 && pt < (1 << 16) && pl < (1 << 16), "qconv: bad pads");
  TORCH_CHECK(OH >= 1 && OW >= 1 && OH < (1 << 24) && OW < (1 << 24), "qconv: bad output size");
  TORCH_CHECK(O >= 1 && zx >= -65536 && zx <= 65536, "qconv: bad O or zero point");
  const int v = isa_resolve(isa);
  const int64_t ks = check_b(Bp, O);
  Requant q = make_requant(O, mult, bias_q, bias_f, fp_m, fp_n, rounding, ys, zy, lo, hi);
  nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024));
  const torch::Tensor X4 = X.dim() == 4 ? X : X.unsqueeze(0);
  const int64_t N = X4.size(0), P = OH * OW;
  const bool onhwc = layout & kOutNHWC;
  auto out = torch::empty(X.dim() == 4 ? (onhwc ? std::vector<int64_t>{N, P, O} : std::vector<int64_t>{N, O, P})
                                       : (onhwc ? std::vector<int64_t>{P, O} : std::vector<int64_t>{O, P}),
                          torch::dtype(out_type(out_code)));
  if (N == 0) return out;
  int32_t* ao = acc_out_ptr(acc_out, N * O * P, "qconv");
  const Geo g{kh, kw, sh, sw, dh, dw, pt, pl, OH, OW};
  const bool ovf = ks == 4 ? conv_impl<uint8_t>(X4, zx, Bp, wsum, g, implicit, q, out, ao, nthreads, v, layout)
                           : conv_impl<int16_t>(X4, zx, Bp, wsum, g, implicit, q, out, ao, nthreads, v, layout);
  TORCH_CHECK(!ovf, "accumulator plus bias overflows int32");
  return out;
}

torch::Tensor qgemm(const torch::Tensor& X, int64_t zx, const torch::Tensor& Bp, const torch::Tensor& wsum,
                    int64_t O, const torch::Tensor& mult, const torch::Tensor& bias_q,
                    const torch::Tensor& bias_f, const torch::Tensor& fp_m, const torch::Tensor& fp_n,
                    int64_t rounding, double ys, int64_t zy, int64_t lo, int64_t hi, int64_t out_code,
                    const torch::Tensor& acc_out, int64_t nthreads, int64_t isa) {
  TORCH_CHECK(X.dim() == 2 && X.is_contiguous(), "qgemm: X must be contiguous codes [M, K]");
  TORCH_CHECK(O >= 1 && zx >= -65536 && zx <= 65536, "qgemm: bad O or zero point");
  const int v = isa_resolve(isa);
  const int64_t ks = check_b(Bp, O);
  Requant q = make_requant(O, mult, bias_q, bias_f, fp_m, fp_n, rounding, ys, zy, lo, hi);
  nthreads = std::max<int64_t>(1, std::min<int64_t>(nthreads, 1024));
  const int64_t M = X.size(0);
  auto out = torch::empty({M, O}, torch::dtype(out_type(out_code)));
  int32_t* ao = acc_out_ptr(acc_out, O * M, "qgemm");
  const bool ovf = ks == 4 ? gemm_impl<uint8_t>(X, zx, Bp, wsum, q, out, ao, nthreads, v)
                           : gemm_impl<int16_t>(X, zx, Bp, wsum, q, out, ao, nthreads, v);
  TORCH_CHECK(!ovf, "accumulator plus bias overflows int32");
  return out;
}

}  // namespace dal_npu
