// quantized_linear's int8-input product in AMX tiles (the AVX512_AMX variant; amx_int8_tiles.h),
// for int8 and int4 weights whose groups are whole blocks of 32 inputs, any number of tokens.
//
// Each block of 32 inputs has its own input scale per token, so the int32 sums cannot run past a
// block: the tiles step 32 inputs at a time (tdpbssd on 16 rows x 16 tokens x 32), and each
// block's 16 x 16 sums are converted and added to fp32 accumulators as
// acc[o, t] += float(sum) * d[t, b] * scale[o, g] with the tokens in the vector lanes (d laid out
// by block, tokens in a row). After the last block the zeros' part comes off,
// offset[o, g] * (the rounded input's sum over group g) for each group (offset = zero * scale,
// or a K-quant's minimum term), and each 16 x 16 is transposed to the output's rows. The weight
// rows of a block of 32 are widened once to int8 in contiguous tiles (int4: a 16-byte chunk's
// low nibbles are its inputs 0-15, the high ones 16-31, unsigned 0..15) and reused for every 32
// tokens; rows past n are zeros and never stored.
#pragma once

#if defined(CPU_CAPABILITY_AMX)
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels/linear/amx_int8_tiles.h"
#include "kernels/linear/quantized_linear_int8_input_lanes.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kBlockTile = kTileRows * kBlock;  // bytes of a tile of 16 rows x 32 inputs

/// Whether the tiles take w: int8 or int4 in groups of whole blocks of 32.
inline bool tiles_take(const QuantizedWeight& w) {
  return (w.format == F::kInt8 || w.format == F::kInt4) && w.group_size % kBlock == 0;
}

/// Rows [o0, o0 + 32) of w (those below n; zeros past it) as int8 A tiles, block b's 16-row tile
/// r at a + (2 * b + r) * kBlockTile, each row's 32 inputs in order.
template <F f>
void widen_rows(const QuantizedWeight& w, int64_t o0, int8_t* a) {
  const int64_t k = w.k, blocks = k / kBlock;
  const auto* q = static_cast<const uint8_t*>(w.q);
  for (int64_t i = 0; i < 2 * kTileRows; ++i) {
    const int64_t o = o0 + i, r = i / kTileRows, row = i % kTileRows;
    for (int64_t b = 0; b < blocks; ++b) {
      int8_t* dst = a + (2 * b + r) * kBlockTile + row * kBlock;
      if (o >= w.n) {
        std::memset(dst, 0, kBlock);
      } else if constexpr (f == F::kInt8) {
        std::memcpy(dst, q + o * k + b * kBlock, kBlock);
      } else {
        const __m128i packed =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + o * (k / 2) + b * 16));
        const __m128i low = _mm_set1_epi8(0x0f);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_and_si128(packed, low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16),
                         _mm_and_si128(_mm_srli_epi16(packed, 4), low));
      }
    }
  }
}

/// acc[i] (row i of a 16-row A tile, its 16 tokens in the lanes) = sum over the blocks b of
/// float(rows . tokens over block b) * d[b * stride + lane] * s[(b / per_group) * 32 + i]: A's
/// block b at a + 2 * b * kBlockTile, B's at tokens + b * kBlockTile. Four blocks go through
/// the four C tiles in turn (A and B through two tiles each), so that one block's tile product
/// runs while the sums before it are scaled; the accumulators stay in registers.
inline void output_tile(const int8_t* a, const int8_t* tokens, const float* d, int64_t stride,
                        const float* s, int64_t blocks, int64_t per_group, int32_t* dots,
                        __m512* acc) {
  for (int64_t i = 0; i < kTileRows; ++i) acc[i] = _mm512_setzero_ps();
  const auto scale_add = [&](int64_t b, const int32_t* sums) {
    const __m512 db = _mm512_loadu_ps(d + b * stride);
    const float* sb = s + (b / per_group) * 2 * kTileRows;
    for (int64_t i = 0; i < kTileRows; ++i) {
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + i * kTileRows)),
                                     db);
      acc[i] = _mm512_fmadd_ps(v, _mm512_set1_ps(sb[i]), acc[i]);
    }
  };
  constexpr int64_t kC = kTileRows * kTileRows;  // int32 of a C tile
  constexpr int64_t kStride = kTileRows * sizeof(int32_t);
#define KVSERVE_BLOCK_TILE(c, ta, tb, b)                                 \
  _tile_zero(c);                                                        \
  _tile_loadd(ta, a + 2 * (b) * kBlockTile, kBlock);                    \
  _tile_loadd(tb, tokens + (b) * kBlockTile, kTileBytes);               \
  _tile_dpbssd(c, ta, tb);                                              \
  _tile_stored(c, dots + (c) * kC, kStride)
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    KVSERVE_BLOCK_TILE(0, 4, 6, b);
    KVSERVE_BLOCK_TILE(1, 5, 7, b + 1);
    KVSERVE_BLOCK_TILE(2, 4, 6, b + 2);
    KVSERVE_BLOCK_TILE(3, 5, 7, b + 3);
    for (int64_t j = 0; j < 4; ++j) scale_add(b + j, dots + j * kC);
  }
  for (; b < blocks; ++b) {
    KVSERVE_BLOCK_TILE(0, 4, 6, b);
    scale_add(b, dots);
  }
#undef KVSERVE_BLOCK_TILE
}

/// y [m, n] (fp32) = the int8-input product of x (rounded in blocks, in input order) and w.
template <F f>
void tile_product(const RoundedInput& x, const QuantizedWeight& w, int64_t m, float* y) {
  const int64_t k = w.k, n = w.n, blocks = x.blocks, groups = x.groups;
  const int64_t per_group = blocks / groups, tiles = token_tiles(m), padded = tiles * kTileRows;
  const bool zero = !x.group_sum.empty();
  // B tiles (blocks of 16 tokens x 32 inputs), and the blocks' scales and the groups' sums with
  // tokens in a row, zeros past m.
  LineVector<int8_t> packed(static_cast<size_t>(tiles * k * kTileRows));
  LineVector<float> scale(static_cast<size_t>(blocks * padded), 0.0f);
  LineVector<float> sums(zero ? static_cast<size_t>(groups * padded) : 0, 0.0f);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kTileRows, count = std::min(m, end * kTileRows) - first;
    pack_tokens(x.q.data() + first * k, count, k, kBlock,
                packed.data() + begin * k * kTileRows);
    for (int64_t t = first; t < first + count; ++t) {
      for (int64_t b = 0; b < blocks; ++b) scale[b * padded + t] = x.scale[t * blocks + b];
      for (int64_t g = 0; zero && g < groups; ++g) {
        sums[g * padded + t] = x.group_sum[t * groups + g];
      }
    }
  });
  static const TileTasks tasks(kBlock);
  const int64_t pairs = (n + 2 * kTileRows - 1) / (2 * kTileRows);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    tasks.begin();
    LineVector<int8_t> a(static_cast<size_t>(2 * kTileRows * k));
    // Each group's scale and zero term for the 32 rows, [groups, 32].
    LineVector<float> scales(static_cast<size_t>(groups * 2 * kTileRows), 0.0f);
    LineVector<float> offsets(zero ? scales.size() : 0, 0.0f);
    std::vector<float> params = quantized_row_params_buffer(w, groups);
    if (params.empty()) params.resize(2 * groups);
    alignas(64) int32_t dots[4 * kTileRows * kTileRows];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t o0 = pair * 2 * kTileRows, rows = std::min(2 * kTileRows, n - o0);
      const int rb = rows > kTileRows ? 2 : 1;
      widen_rows<f>(w, o0, a.data());
      for (int64_t i = 0; i < rows; ++i) {
        const QuantizedRowParams p = quantized_row_params(w, o0 + i, groups, params.data());
        for (int64_t g = 0; g < groups; ++g) {
          scales[g * 2 * kTileRows + i] = p.scales[g];
          if (zero) {
            offsets[g * 2 * kTileRows + i] = p.offsets != nullptr ? p.offsets[g]
                                             : p.zeros != nullptr ? p.zeros[g] * p.scales[g]
                                                                  : 0.0f;
          }
        }
      }
      for (int r = 0; r < rb; ++r) {
        const int64_t count = std::min(kTileRows, rows - r * kTileRows);
        const auto mask = static_cast<__mmask16>((1u << count) - 1);
        for (int64_t tb = 0; tb < tiles; ++tb) {
          const int64_t t0 = tb * kTileRows;
          __m512 acc[kTileRows];
          output_tile(a.data() + r * kBlockTile, packed.data() + tb * blocks * kBlockTile,
                      scale.data() + t0, padded, scales.data() + r * kTileRows, blocks,
                      per_group, dots, acc);
          for (int64_t g = 0; zero && g < groups; ++g) {  // the zeros' part
            const float* off = offsets.data() + g * 2 * kTileRows + r * kTileRows;
            const __m512 total = _mm512_loadu_ps(sums.data() + g * padded + t0);
            for (int64_t i = 0; i < kTileRows; ++i) {
              acc[i] = _mm512_fnmadd_ps(_mm512_set1_ps(off[i]), total, acc[i]);
            }
          }
          transpose16(acc);  // token c's outputs o0 + 16r .. (those below n)
          for (int64_t c = 0; c < kTileRows && t0 + c < m; ++c) {
            _mm512_mask_storeu_ps(y + (t0 + c) * n + o0 + r * kTileRows, mask, acc[c]);
          }
        }
      }
    }
    TileTasks::end();
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu

#endif  // CPU_CAPABILITY_AMX
