// AMX-INT8 micro kernel of qconv.cpp (variant amx_int8): tdpbusd, u8 x s8 quads summed into
// int32 tiles, exact (no saturation, wraps modulo 2^32 like vpdpbusd), so it agrees with every
// other variant bit for bit.
//
// Tiles (one palette-1 configuration, all 16 rows x 64 bytes): C 0..3 = 2 x 2 blocks of 16
// pixels x 16 channels (int32), A 4..5 = 16 pixels x 64 reduction bytes, B 6..7 = 16 quads x
// 16 channels x 4 -- exactly 1 KB of the [K/4][16][4] int8 panels every VNNI variant uses, so
// the weights packed at load serve AMX unchanged (row stride 64 bytes).
// A: the pixel rows (implicit GEMM row pointers + tap offsets) are first copied into a
// contiguous [rows][Kpad] block (Kpad = K rounded up to 64, zero tail), since a tile load
// needs one fixed row stride -- unless they already are such a matrix (qconv.cpp amx_task
// reads those in place); the K tail (K/4 mod 16 quads) reads B from a zero-padded copy
// (never past the panel's end). Each output is summed over its whole reduction by one call, in
// a fixed order: results do not depend on the thread count.
// The tile configuration is loaded at the start of every task (TileScope) and released at its
// end: other code on the same thread (onnxruntime's kernels, say) may load its own in between.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "isa.h"

namespace dal_npu {
namespace amx {

struct alignas(64) TileCfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A growable buffer whose data starts on a 64-byte line. Every tile row the kernel loads or
// stores must be line aligned: a 64-byte row straddling two lines costs two line reads, and
// measured on this CPU the 2 x 2 tdpbusd step with operands misaligned by 16 bytes ran at 1765
// GOP/s against 3730 GOP/s aligned (L2-resident, same loop).
template <typename V>
struct Aligned {
  std::unique_ptr<uint8_t[]> raw;
  size_t cap = 0;
  V* p = nullptr;
  V* get(size_t n) {  // room for n values (contents kept only while n <= the capacity)
    if (n > cap) {
      raw.reset(new uint8_t[n * sizeof(V) + 64]);
      const uintptr_t a = reinterpret_cast<uintptr_t>(raw.get());
      p = reinterpret_cast<V*>(raw.get() + (64 - a % 64) % 64);
      cap = n;
    }
    return p;
  }
};

inline bool line_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

// rows rp[0..pn) at tap offsets toff[0..ntaps) (CK quads each) -> A[pn rounded to 16][Kpad]
// (rows past pn and the K tail are zero).
inline void pack_a(const uint8_t* const* rp, int64_t pn, const int64_t* toff, int64_t ntaps, int64_t CK,
                   uint8_t* A, int64_t Kpad) {
  const int64_t tapb = CK * 4, K = ntaps * tapb, rows = (pn + 15) / 16 * 16;
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* d = A + r * Kpad;
    if (r < pn) {
      for (int64_t t = 0; t < ntaps; ++t) std::memcpy(d + t * tapb, rp[r] + toff[t], tapb);
      std::memset(d + K, 0, Kpad - K);
    } else {
      std::memset(d, 0, Kpad);
    }
  }
}

// Rows rp[0..pn) + off at one tap, K4 a multiple of 16 quads, pn a multiple of 16, equally
// spaced and line aligned: already the strided matrix a tile load reads, no copy needed.
template <typename E>
inline bool in_place(const E* const* rp, int64_t pn, int64_t ntaps, int64_t K4, int64_t off) {
  if (sizeof(E) != 1 || ntaps != 1 || K4 % 16 != 0 || pn % 16 != 0 || pn == 0) return false;
  if (!line_aligned(rp[0] + off)) return false;
  const int64_t stride = rp[1] - rp[0];
  if (stride <= 0) return false;
  for (int64_t r = 2; r < pn; ++r)
    if (rp[r] - rp[0] != r * stride) return false;
  return true;
}

// One copy of all P rows (pack_a's [rows][Kpad] form), shared by the channel ranges of a small
// layer; filled 16 rows at a time by the threads (pack), read by every task at at(p0).
struct Rows {
  Aligned<uint8_t> buf;
  int64_t Kpad = 0;
  void reserve(int64_t P, int64_t K4) {
    Kpad = (K4 * 4 + 63) / 64 * 64;
    buf.get(static_cast<size_t>((P + 15) / 16 * 16 * Kpad));
  }
  const uint8_t* at(int64_t p0) const { return buf.p + p0 * Kpad; }
  void pack(const uint8_t* const* rp, int64_t P, int64_t r0, const int64_t* toff, int64_t ntaps, int64_t CK) {
    pack_a(rp + r0, std::min<int64_t>(16, P - r0), toff, ntaps, CK, buf.p + r0 * Kpad, Kpad);
  }
};

// The last (K/4 mod 16) quads of each of npan panels, zero padded to 16 x 64 bytes.
inline void pack_b_tail(const int8_t* B, int64_t panel_size, int64_t npan, int64_t K4, int8_t* tail) {
  const int64_t full = K4 / 16 * 16, rem = K4 - full;
  for (int64_t p = 0; p < npan; ++p) {
    int8_t* d = tail + p * 1024;
    std::memcpy(d, B + p * panel_size + full * 64, rem * 64);
    std::memset(d + rem * 64, 0, 1024 - rem * 64);
  }
}

// k steps (64 bytes) per K block of gemm: ceil(nk / blocks) with blocks = ceil(nk / 9), so that a
// block of the group's rows (32 x <= 576 bytes, 18 KB) stays in L1 while every panel pair passes
// (measured 784x2304x256, tiles alone, blocks of at most 4 / 6 / 9 / 12 / 18 / 36 steps: 2800 /
// 3000 / 3250 / 3200 / 2900 / 2760 GOP/s).
inline int64_t k_block(int64_t nk) {
  constexpr int64_t kMaxSteps = 9;
  if (nk <= kMaxSteps) return nk;
  const int64_t blocks = (nk + kMaxSteps - 1) / kMaxSteps;
  return (nk + blocks - 1) / blocks;
}

// The tile configuration gemm runs under (palette 1, tiles 0..7 all 16 rows x 64 bytes), loaded
// by the caller around a task's gemm calls (TileScope) and released at its end: other code on the
// same thread (onnxruntime's own AMX kernels, say) may load its own between two tasks. Once per
// task, not once per 32-pixel group as before: ldtilecfg + tilerelease per group cost 20% of a
// 64-channel 3x3 conv's tile time (3136x576x64, tiles alone: 1800 -> 2240 GOP/s).
// (a constant: gcc 12 dropped the stores filling a local TileCfg as dead once ldtilecfg was its
// only reader in the function, and the tiles ran unconfigured -- SIGILL)
DAL_TARGET_AMX inline void tiles_on() {
  static constexpr TileCfg cfg = [] {
    TileCfg c;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  _tile_loadconfig(&cfg);
}
DAL_TARGET_AMX inline void tiles_off() { _tile_release(); }
// tiles_on() .. tiles_off() for a scope when on (the AMX variant runs; a no-op otherwise, so that
// a CPU without AMX never executes either)
struct TileScope {
  const bool on;
  explicit TileScope(bool o) : on(o) {
    if (on) tiles_on();
  }
  ~TileScope() {
    if (on) tiles_off();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// One group x panel pair x K block of gemm: the 2 x 2 accumulator tiles zeroed (first block) or
// loaded from c (row stride lc int32), k steps [k0, k1) summed, stored back. two: a second tile
// row (rows 16..31), pair: a second panel.
DAL_TARGET_AMX inline void gemm_unit(const uint8_t* a0, int64_t sa, bool two, const int8_t* b0, const int8_t* b1,
                                     const int8_t* t0, const int8_t* t1, bool pair, int64_t kt, int64_t k0,
                                     int64_t k1, int32_t* c, int64_t lc) {
  const uint8_t* a1 = a0 + 16 * sa;
  if (k0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, lc * 4);
    if (pair) _tile_loadd(1, c + 16, lc * 4);
    if (two) {
      _tile_loadd(2, c + 16 * lc, lc * 4);
      if (pair) _tile_loadd(3, c + 16 * lc + 16, lc * 4);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    const int8_t* x0 = k < kt ? b0 + k * 1024 : t0;
    const int8_t* x1 = k < kt ? b1 + k * 1024 : t1;
    _tile_loadd(4, a0 + k * 64, sa);
    _tile_loadd(6, x0, 64);
    _tile_dpbusd(0, 4, 6);
    if (pair) {
      _tile_loadd(7, x1, 64);
      _tile_dpbusd(1, 4, 7);
    }
    if (two) {
      _tile_loadd(5, a1 + k * 64, sa);
      _tile_dpbusd(2, 5, 6);
      if (pair) _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, c, lc * 4);
  if (pair) _tile_stored(1, c + 16, lc * 4);
  if (two) {
    _tile_stored(2, c + 16 * lc, lc * 4);
    if (pair) _tile_stored(3, c + 16 * lc + 16, lc * 4);
  }
}

// Weights beyond this many bytes do not stay in L2 next to the rows (2 MB a core here): gemm
// then runs every group of the call inside each panel pair and K block (groups_inside).
constexpr int64_t kWeightsL2 = 1 << 20;
inline bool groups_inside(int64_t pn, int64_t npan, int64_t panel_size) {
  return pn > 32 && npan * panel_size > kWeightsL2;
}

// C[pn][16 * npan] (row stride ldc int32) = A[pn][K] (row stride lda bytes: pack_a's Kpad, or
// the rows in place; every 64-byte step it loads lies within a row) x panels B[npan] (K4 quads
// each), under tiles_on() (the caller's TileScope). 32-pixel groups; inside a group the
// reduction runs in K blocks of k_block steps, every panel pair passing each block: the block's
// rows (32 x <= 576 bytes) stay in L1 and only the weights stream from L2 (with the whole
// reduction per pair, as before, the group's 32 x K rows -- 73 KB for K = 2304 -- were reread
// from L2 by every pair). Between blocks the 2 x 2 accumulator tiles are stored to C and loaded
// back: int32 sums wrap like the tiles, so each output is still the same k-ordered exact sum.
// Weights too large for L2 (groups_inside: ResNet's 512-channel 3x3, 2.4 MB) would stream from
// L3 once per group: then every group of the call runs inside each pair's K block, which serves
// them all from L1 (49x4608x512, tiles alone: 1310 -> 1650 GOP/s; 98 rows: 1370 -> 2000).
// done(r0, r1): rows [r0, r1) of C are final -- after each group (the caller requantizes them
// while they are in L1), once for all rows with groups_inside. One call per task rather than
// one per group: something costs ~0.2 us per call (not the tile configuration nor the
// thread-local buffer, measured): 3136x576x64, tiles alone, 1890 GOP/s in 32-row calls, 2270 in one.
// Tried, not kept (784x2304x256 unless said): software prefetch (2151 against 2693 GOP/s once
// aligned; of the next A block -3%), N chunks keeping C in L1 (A reread per chunk, -3%), A
// packed tile-contiguous per block (-15%, the copy), panel pairs interleaved so that a k step's
// two B tiles are adjacent (+-1%), the previous group's requantizer spread between the units
// (no gain: it does not overlap the tiles).
// tail: pack_b_tail's copy when K4 % 16 != 0. A group of fewer than 32 rows accumulates in a
// thread-local 32-row buffer, copied out before its done().
// An odd last panel runs one tile column (tiles 1 and 3 idle), a last group of <= 16 pixels
// one tile row (tiles 2 and 3 idle). Each output is one k-ordered sum whatever the loop order.
template <typename Done>
DAL_TARGET_AMX inline void gemm(const uint8_t* A, int64_t pn, int64_t lda, const int8_t* B, int64_t panel_size,
                                int64_t npan, int64_t K4, const int8_t* tail, int32_t* C, int64_t ldc,
                                Done&& done) {
  const int64_t kt = K4 / 16, nk = kt + (K4 % 16 != 0), kb = k_block(nk);
  // full groups accumulate in place; a short last one in 32 rows of its own (tile stores write 16 rows)
  thread_local Aligned<int32_t> edge_buf;
  const int64_t wc = (npan + 1) / 2 * 32, mlast = (pn - 1) / 32 * 32, nlast = pn - mlast;
  int32_t* edge = nlast < 32 ? edge_buf.get(static_cast<size_t>(32 * wc)) : nullptr;
  auto unit = [&](int64_t m0, int64_t p, int64_t k0) {
    const bool pair = p + 1 < npan, short_group = m0 == mlast && edge;
    const int8_t* b0 = B + p * panel_size;
    gemm_unit(A + m0 * lda, lda, pn - m0 > 16, b0, pair ? b0 + panel_size : b0, tail ? tail + p * 1024 : nullptr,
              tail ? tail + (pair ? p + 1 : p) * 1024 : nullptr, pair, kt, k0, std::min(nk, k0 + kb),
              short_group ? edge + p * 16 : C + m0 * ldc + p * 16, short_group ? wc : ldc);
  };
  auto copy_edge = [&] {
    if (edge)
      for (int64_t r = 0; r < nlast; ++r) std::memcpy(C + (mlast + r) * ldc, edge + r * wc, npan * 16 * 4);
  };
  if (groups_inside(pn, npan, panel_size)) {
    for (int64_t k0 = 0; k0 < nk; k0 += kb)
      for (int64_t p = 0; p < npan; p += 2)
        for (int64_t m0 = 0; m0 < pn; m0 += 32) unit(m0, p, k0);
    copy_edge();
    done(int64_t{0}, pn);
    return;
  }
  for (int64_t m0 = 0; m0 < pn; m0 += 32) {
    for (int64_t k0 = 0; k0 < nk; k0 += kb)
      for (int64_t p = 0; p < npan; p += 2) unit(m0, p, k0);
    if (m0 == mlast) copy_edge();
    done(m0, std::min<int64_t>(pn, m0 + 32));
  }
}

}  // namespace amx
}  // namespace dal_npu
