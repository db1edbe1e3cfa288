// Body of LLM.int8()'s integer part (int8_linear_stub): each token's inliers rounded to int8 at
// one scale, int32 dot products with the int8 weight rows, then the token's and the row's scales;
// compiled once per CPU capability.
//
// The product takes int8 by int8 the way llama.cpp's Q8_0 kernels do: the weight's sign moves
// onto the input (sign_epi8 on AVX2; a masked negate on AVX-512, which has no sign_epi8) so that
// |w| is the unsigned operand of vpmaddubsw (pairs summed into int16: at most 2 * 128 * 127, no
// saturation) and vpmaddwd by ones (into int32 lanes); with VNNI (the AVX2_VNNI and AVX512_VNNI
// variants) one vpdpbusd does both. A 64-byte (AVX-512) or 32-byte (AVX2) load of a row is that
// many products, twice what widening the bytes to int16 for vpmaddwd / vpdpwssd gave. A row of k
// inputs stays exact in int32 for k < 2^17 (|q w| <= 127 * 128).
//
// Blocks of 4 tokens x 2 weight rows share every load (each row's bytes and magnitude once for the
// 4 tokens, each token's inputs once for the 2 rows); the rows ask for their bytes 8 KB ahead of
// their reads (as the int8-input kernels of quantized_linear do, which read a streamed projection
// 1.1-1.25x faster for it), as prefetch_stream says for the CPU. Rows go to the threads in blocks.
//
// The AVX512_AMX variant multiplies in AMX tiles instead (amx_int8_tiles.h) wherever k is a
// multiple of 64: 32 weight rows by 32 tokens a block, four tdpbssd a step of 64 inputs, each
// 16 x 16 x 64 products; the sums are the same int32 and take the same scales in the same order,
// so the outputs are the vector blocks' bit for bit. It does so from 8 tokens on
// (kTileMinTokens): below, the vector rows read the weight faster, as the tiles waste most of
// their columns; from 16 tokens the tiles multiply 4-5x faster (benchmarks/bench_quant.py --only
// prefill).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"
#include "kernels/linear/amx_int8_tiles.h"
#include "kernels/linear/int8_rounding.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kTokens = 4;   // tokens per block
constexpr int64_t kRows = 2;     // weight rows per block
constexpr int64_t kRowGrain = 16;
constexpr int64_t kPrefetchAhead = 8192;
#if defined(CPU_CAPABILITY_AMX)
// Tokens from which the tiles take the product (tile_linear); below, the vector blocks, which
// read a streamed [5632, 2048] weight faster at 1 and 4 tokens (18 and 16 GB/s against 15-17 and
// 14-15), as fast at 6, and slower at 8 (10-11 against 14-16; Emerald Rapids VM).
constexpr int64_t kTileMinTokens = 8;
#endif

#if defined(CPU_CAPABILITY_AVX512)
using IVec = __m512i;
constexpr int64_t kStep = 64;  // bytes a load
inline IVec load(const int8_t* p) { return _mm512_loadu_si512(p); }
inline IVec magnitude(IVec w) { return _mm512_abs_epi8(w); }  // |-128| is 0x80: 128 unsigned
inline IVec signed_input(IVec x, IVec w) {
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline IVec dot_add(IVec acc, IVec u, IVec s) {
#if defined(CPU_CAPABILITY_VNNI)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                 _mm512_set1_epi16(1)));
#endif
}
inline IVec zero() { return _mm512_setzero_si512(); }
inline int32_t sum(IVec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(CPU_CAPABILITY_AVX2)
using IVec = __m256i;
constexpr int64_t kStep = 32;
inline IVec load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec magnitude(IVec w) { return _mm256_sign_epi8(w, w); }
// x where w > 0, -x where w < 0, 0 where w == 0 (whose product is 0 either way).
inline IVec signed_input(IVec x, IVec w) { return _mm256_sign_epi8(x, w); }
inline IVec dot_add(IVec acc, IVec u, IVec s) {
#if defined(CPU_CAPABILITY_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}
inline IVec zero() { return _mm256_setzero_si256(); }
inline int32_t sum(IVec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
#endif

// Rounds token t's row of x to q at scale[t] = max|x| / 127 (llm_int8_linear.h): q = x / scale
// rounded half to even, in fp32 as the reference divides (int8_rounding.h); a row of zeros keeps
// scale 0 and q 0; a row holding a NaN or an infinity gets q 0 and scale NaN, so that its outputs
// are NaN.
void round_row(const float* x, int64_t k, int8_t* q, float* scale) {
  bool finite;
  const float amax = abs_max(x, k, finite);
  if (!finite) {
    std::fill(q, q + k, int8_t{0});
    *scale = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float s = amax / 127.0f;
  round_to_int8<true>(x, k, s > 0.0f ? s : 1.0f, q);
  *scale = s;
}

// out[t, o] for tokens [t0, t0 + T) and rows [o0, o0 + R).
template <int T, int R>
void block(const int8_t* x, const int8_t* w, int64_t k, int64_t t0, int64_t o0, int64_t n,
           const float* x_scales, const float* w_scales, float* out) {
  int32_t dots[T][R] = {};
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  IVec acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = zero();
  for (; i + kStep <= k; i += kStep) {
    IVec wr[R], mag[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* row = w + (o0 + r) * k + i;
      if (i % 64 == 0) prefetch_stream(row + kPrefetchAhead);
      wr[r] = load(row);
      mag[r] = magnitude(wr[r]);
    }
    for (int t = 0; t < T; ++t) {
      const IVec xt = load(x + (t0 + t) * k + i);
      for (int r = 0; r < R; ++r) acc[t][r] = dot_add(acc[t][r], mag[r], signed_input(xt, wr[r]));
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) dots[t][r] = sum(acc[t][r]);
#endif
  for (; i < k; ++i) {
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        dots[t][r] += static_cast<int32_t>(x[(t0 + t) * k + i]) * w[(o0 + r) * k + i];
      }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      out[(t0 + t) * n + o0 + r] =
          static_cast<float>(dots[t][r]) * x_scales[t0 + t] * w_scales[o0 + r];
    }
}

template <int R>
void rows_block(const int8_t* x, int64_t m, const int8_t* w, int64_t k, int64_t o0, int64_t n,
                const float* x_scales, const float* w_scales, float* out) {
  int64_t t = 0;
  for (; t + kTokens <= m; t += kTokens) {
    block<kTokens, R>(x, w, k, t, o0, n, x_scales, w_scales, out);
  }
  for (; t < m; ++t) block<1, R>(x, w, k, t, o0, n, x_scales, w_scales, out);
}

#if defined(CPU_CAPABILITY_AMX)
// out[t, o0 + i] = float(dots[i][t - t0]) * x_scales[t] * w_scales[o0 + i] for the RB x TB tiles
// of dots (row stride TB * 16), tokens from t0 below m: each 16 x 16 converted and scaled with
// tokens in the lanes (the same operations, in the same order, as the vector blocks'), then
// transposed so that a token's 16 outputs are one store.
void store_tiles(const int32_t* dots, int rb, int tt, int64_t t0, int64_t o0, int64_t m,
                 int64_t n, const float* x_scales, const float* w_scales, float* out) {
  const int64_t columns = tt * kTileRows;
  for (int r = 0; r < rb; ++r) {
    for (int c = 0; c < tt; ++c) {
      const int64_t first = t0 + c * kTileRows, tokens = std::min(kTileRows, m - first);
      if (tokens <= 0) continue;
      const __m512 xs = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << tokens) - 1),
                                              x_scales + first);
      __m512 v[kTileRows];
      for (int64_t i = 0; i < kTileRows; ++i) {
        const int64_t row = r * kTileRows + i;
        const __m512i d = _mm512_loadu_si512(dots + row * columns + c * kTileRows);
        v[i] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), xs),
                             _mm512_set1_ps(w_scales[o0 + row]));
      }
      transpose16(v);
      for (int64_t j = 0; j < tokens; ++j) {
        _mm512_storeu_ps(out + (first + j) * n + o0 + r * kTileRows, v[j]);
      }
    }
  }
}

// out for rows [0, 16 * (n / 16)) in tiles: blocks of 32 rows (the last may be 16) against
// 32 tokens (the last may be 16; tokens past m are the packing's zeros and are not stored). The
// rows past the last whole tile go through the vector blocks.
void tile_linear(const int8_t* q, int64_t m, int64_t k, const int8_t* w, int64_t n,
                 const float* x_scales, const float* w_scales, float* out) {
  const int64_t steps = k / kTileBytes, tiles = token_tiles(m), row_tiles = n / kTileRows;
  LineVector<int8_t> packed(static_cast<size_t>(tiles * steps * kTileSize));
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kTileRows, count = std::min(m, end * kTileRows) - first;
    pack_tokens(q + first * k, count, k, kTileBytes, packed.data() + begin * steps * kTileSize);
  });
  static const TileTasks tasks;
  at::parallel_for(0, (row_tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    tasks.begin();
    alignas(64) int32_t dots[4 * kTileRows * kTileRows];
    LineVector<int8_t> rows(static_cast<size_t>(2 * kTileRows * k));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = 2 * b * kTileRows;
      const int rb = 2 * b + 2 <= row_tiles ? 2 : 1;
      const TileOperand a = rb == 2 ? pack_rows<2>(w + o0 * k, k, rows.data())
                                    : pack_rows<1>(w + o0 * k, k, rows.data());
      for (int64_t tb = 0; tb < tiles; tb += 2) {
        const int tt = tb + 2 <= tiles ? 2 : 1;
        const TileOperand tokens{packed.data() + tb * steps * kTileSize, kTileBytes, kTileSize,
                                 steps * kTileSize};
        if (rb == 2) {
          tt == 2 ? tile_dots<2, 2>(a, tokens, steps, dots)
                  : tile_dots<2, 1>(a, tokens, steps, dots);
        } else {
          tt == 2 ? tile_dots<1, 2>(a, tokens, steps, dots)
                  : tile_dots<1, 1>(a, tokens, steps, dots);
        }
        store_tiles(dots, rb, tt, tb * kTileRows, o0, m, n, x_scales, w_scales, out);
      }
    }
    TileTasks::end();
  });
  at::parallel_for(row_tiles * kTileRows, n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) rows_block<1>(q, m, w, k, o, n, x_scales, w_scales, out);
  });
}
#endif

void int8_linear_impl(const float* x, int64_t m, int64_t k, const int8_t* w, int64_t n,
                      const float* w_scales, float* out) {
  LineVector<int8_t> q(static_cast<size_t>(m * k));
  std::vector<float> x_scales(static_cast<size_t>(m));
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) round_row(x + t * k, k, q.data() + t * k, &x_scales[t]);
  });
#if defined(CPU_CAPABILITY_AMX)
  if (m >= kTileMinTokens && k % kTileBytes == 0 && n >= kTileRows) {
    tile_linear(q.data(), m, k, w, n, x_scales.data(), w_scales, out);
    return;
  }
#endif
  if (m <= kTokens) {  // one row at a time: a row streamed alone reads fastest
    at::parallel_for(0, n, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) {
        rows_block<1>(q.data(), m, w, k, o, n, x_scales.data(), w_scales, out);
      }
    });
    return;
  }
  const int64_t blocks = (n + kRows - 1) / kRows;
  at::parallel_for(0, blocks, kRowGrain / kRows, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * kRows;
      if (o0 + kRows <= n) {
        rows_block<kRows>(q.data(), m, w, k, o0, n, x_scales.data(), w_scales, out);
      } else {
        for (int64_t o = o0; o < n; ++o) {
          rows_block<1>(q.data(), m, w, k, o, n, x_scales.data(), w_scales, out);
        }
      }
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(int8_linear_stub, &int8_linear_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
