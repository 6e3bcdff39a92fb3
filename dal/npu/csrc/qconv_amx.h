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
// The tile configuration is loaded at the start of every call and released at its end: other
// code on the same thread (onnxruntime's kernels, say) may have loaded its own in between.
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

// C[pn][16 * npan] (row stride ldc int32) = A[pn][K] (row stride lda bytes: pack_a's Kpad, or
// the rows in place; every 64-byte step it loads lies within a row) x panels B[npan] (K4 quads each).
// 32-pixel groups outside, panel pairs inside: a group's rows (32 x K bytes) stay in L1 / L2
// while every pair of the task passes (run_core calls it one group at a time, so that the
// group's accumulators are requantized while they are in L1). Software prefetch of the next k
// step's tiles was tried: slower once every operand is line aligned (2151 against 2693 GOP/s).
// tail: pack_b_tail's copy when K4 % 16 != 0. tmp: 2 x 16 x 32 int32 scratch for edge rows.
// An odd last panel runs one tile column (tiles 1 and 3 idle), a last group of <= 16 pixels
// one tile row (tiles 2 and 3 idle). Each output is one k-ordered sum whatever the loop order.
DAL_TARGET_AMX inline void gemm(const uint8_t* A, int64_t pn, int64_t lda, const int8_t* B, int64_t panel_size,
                                int64_t npan, int64_t K4, const int8_t* tail, int32_t* C, int64_t ldc,
                                int32_t* tmp) {
  TileCfg cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t kt = K4 / 16, nk = kt + (K4 % 16 != 0), sa = lda;
  for (int64_t m0 = 0; m0 < pn; m0 += 32) {
    const uint8_t* a0 = A + m0 * lda;
    const uint8_t* a1 = a0 + 16 * lda;
    const bool two = pn - m0 > 16;
    for (int64_t p = 0; p < npan; p += 2) {
      const bool pair = p + 1 < npan;
      const int8_t* b0 = B + p * panel_size;
      const int8_t* b1 = pair ? b0 + panel_size : b0;
      const int8_t* t0 = tail ? tail + p * 1024 : nullptr;
      const int8_t* t1 = tail ? tail + (pair ? p + 1 : p) * 1024 : nullptr;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < nk; ++k) {
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
      const int64_t nr = pn - m0 < 32 ? pn - m0 : 32, nc = pair ? 32 : 16;
      int32_t* c = C + m0 * ldc + p * 16;
      if (nr == 32 && pair) {
        _tile_stored(0, c, ldc * 4);
        _tile_stored(1, c + 16, ldc * 4);
        _tile_stored(2, c + 16 * ldc, ldc * 4);
        _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
        continue;
      }
      _tile_stored(0, tmp, 128);
      if (pair) _tile_stored(1, tmp + 16, 128);
      if (two) {
        _tile_stored(2, tmp + 512, 128);
        if (pair) _tile_stored(3, tmp + 512 + 16, 128);
      }
      for (int64_t r = 0; r < nr; ++r) std::memcpy(c + r * ldc, tmp + r * 32, nc * 4);
    }
  }
  _tile_release();
}

}  // namespace amx
}  // namespace dal_npu
