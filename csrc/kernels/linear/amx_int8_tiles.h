// AMX int8 tiles (Intel Sapphire Rapids and later; the AVX512_AMX kernel variants): the integer
// product of int8 weight rows with many tokens' int8 inputs, 16 rows x 16 tokens per tile.
//
// `tdpbssd` adds to a tile C of 16 x 16 int32 the products of A (16 rows of 64 signed bytes) with
// B (64 signed bytes for each of 16 columns, held as 16 rows of four-byte groups: B's row r holds
// each column's bytes 4r .. 4r + 3). A is a block of 16 weight rows read in place (row-major, any
// stride), so the weight is never repacked; B is a block of 16 tokens' inputs, which pack_tokens
// lays out once per call (a 16 x 16 transpose of four-byte groups). C's row is a weight row and
// its column a token. Each product is exact in int32 (|q w| <= 127 * 128, k < 2^17), so the sums
// are the VNNI kernels' bit for bit. Included by the kernel files, once per CPU capability; only
// the AVX512_AMX variant (CPU_CAPABILITY_AMX) holds any of it.
#pragma once

#if defined(CPU_CAPABILITY_AMX)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kTileRows = 16;   // weight rows (and tokens) a tile
constexpr int64_t kTileBytes = 64;  // inputs a tile step: one A row of bytes
constexpr int64_t kTileSize = kTileRows * kTileBytes;  // bytes of a packed B tile

/// Blocks of 16 tokens that m tokens take.
inline int64_t token_tiles(int64_t m) { return (m + kTileRows - 1) / kTileRows; }

/// Tokens' int8 inputs q [m, k] (row stride k, k a multiple of `step`, which is 64 or 32) as B
/// tiles of `step` inputs: for each block of 16 tokens and each step, step / 4 rows of 64 bytes
/// (16 * step bytes), row r holding tokens 0..15's inputs 4r .. 4r + 3 of the step. Tokens past
/// m are zeros. `packed` holds token_tiles(m) * k * 16 bytes.
inline void pack_tokens(const int8_t* q, int64_t m, int64_t k, int64_t step, int8_t* packed) {
  const int64_t steps = k / step, groups = step / 4;
  for (int64_t tb = 0; tb < token_tiles(m); ++tb) {
    for (int64_t s = 0; s < steps; ++s) {
      auto* tile = reinterpret_cast<int32_t*>(packed + (tb * steps + s) * kTileRows * step);
      for (int64_t t = 0; t < kTileRows; ++t) {
        const int64_t token = tb * kTileRows + t;
        int32_t four[kTileRows] = {};
        if (token < m) std::memcpy(four, q + token * k + s * step, step);
        for (int64_t r = 0; r < groups; ++r) tile[r * kTileRows + t] = four[r];
      }
    }
  }
}

/// The tile configuration every task of a kernel loads (palette 1), for steps of `step` inputs
/// (64, or 32 for blocks of 32 with a scale each): tiles 0-3 C (16 rows x 16 int32), 4-5 A (16
/// rows x step bytes) and 6-7 B (step / 4 rows x 64 bytes). A task loads it before its first
/// tile instruction and releases the tiles after its last (tile state is per thread).
struct TileTasks {
  alignas(64) uint8_t config[64] = {};
  explicit TileTasks(int64_t step = kTileBytes) {
    config[0] = 1;  // palette
    for (int tile = 0; tile < 8; ++tile) {
      const uint16_t bytes = tile == 4 || tile == 5 ? step : kTileBytes;  // bytes a row
      std::memcpy(config + 16 + 2 * tile, &bytes, 2);
      config[48 + tile] = tile >= 6 ? step / 4 : kTileRows;  // rows
    }
  }
  void begin() const { _tile_loadconfig(config); }
  static void end() { _tile_release(); }
};

/// Where a kernel's A (or B) tiles are: the first one's step s at base + s * step, its rows
/// `stride` bytes apart, the second one (RB or TB == 2) `next` bytes after the first.
struct TileOperand {
  const int8_t* base;
  int64_t stride, step, next;
};

/// Weight rows [16 * RB) (k inputs, row stride k bytes) copied as contiguous A tiles: step s's
/// tile r at packed + (s * RB + r) * kTileSize. Read once, the copy is what every block of
/// tokens then loads: 1 KB tiles in a row instead of 16 lines k bytes apart, which the L1 cache
/// holds in few sets (k a multiple of 4 KB puts all 16 in one).
template <int RB>
inline TileOperand pack_rows(const int8_t* rows, int64_t k, int8_t* packed) {
  const int64_t steps = k / kTileBytes;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t r = 0; r < RB * kTileRows; ++r) {
      std::memcpy(packed + (s * RB * kTileRows + r) * kTileBytes, rows + r * k + s * kTileBytes,
                  kTileBytes);
    }
  }
  return {packed, kTileBytes, RB * kTileSize, kTileSize};
}

/// dots[i][j] (RB * 16 weight rows x TB * 16 tokens, int32, row stride TB * 16) = the sums over
/// `steps` steps of 64 inputs of A's rows with B's tokens. RB and TB are 1 or 2: up to four C
/// tiles share each A and B load.
template <int RB, int TB>
inline void tile_dots(const TileOperand& a, const TileOperand& b, int64_t steps, int32_t* dots) {
  _tile_zero(0);
  if constexpr (TB == 2) _tile_zero(1);
  if constexpr (RB == 2) _tile_zero(2);
  if constexpr (RB == 2 && TB == 2) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* as = a.base + s * a.step;
    const int8_t* bs = b.base + s * b.step;
    _tile_loadd(4, as, a.stride);
    _tile_loadd(6, bs, b.stride);
    if constexpr (TB == 2) _tile_loadd(7, bs + b.next, b.stride);
    _tile_dpbssd(0, 4, 6);
    if constexpr (TB == 2) _tile_dpbssd(1, 4, 7);
    if constexpr (RB == 2) {
      _tile_loadd(5, as + a.next, a.stride);
      _tile_dpbssd(2, 5, 6);
      if constexpr (TB == 2) _tile_dpbssd(3, 5, 7);
    }
  }
  constexpr int64_t stride = TB * kTileRows * sizeof(int32_t);
  auto* out = reinterpret_cast<char*>(dots);
  _tile_stored(0, out, stride);
  if constexpr (TB == 2) _tile_stored(1, out + kTileRows * sizeof(int32_t), stride);
  if constexpr (RB == 2) {
    out += kTileRows * stride;
    _tile_stored(2, out, stride);
    if constexpr (TB == 2) _tile_stored(3, out + kTileRows * sizeof(int32_t), stride);
  }
}

/// Transposes 16 x 16 floats in registers: v[i] lane j becomes v[j] lane i.
inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows: elements interleaved
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
  // Quads of rows: v[i + c]'s 128-bit lane L holds rows i .. i + 3 of column 4L + c.
  for (int i = 0; i < 16; i += 4) {
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[i + h]), b = _mm512_castps_pd(t[i + 2 + h]);
      v[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      v[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  // Two shuffles of 128-bit lanes gather each column's four quads.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    v[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    v[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu

#endif  // CPU_CAPABILITY_AMX
