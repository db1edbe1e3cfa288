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
// their reads, non-temporally (as the int8-input kernels of quantized_linear do, which read a
// streamed projection 1.1-1.25x faster for it, and 1.05-1.2x faster again with prefetchnta than
// with prefetcht0). Rows go to the threads in blocks.
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
#include "kernels/linear/int8_rounding.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kTokens = 4;   // tokens per block
constexpr int64_t kRows = 2;     // weight rows per block
constexpr int64_t kRowGrain = 16;
constexpr int64_t kPrefetchAhead = 8192;

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
      if (i % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchAhead),
                                    _MM_HINT_NTA);
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

void int8_linear_impl(const float* x, int64_t m, int64_t k, const int8_t* w, int64_t n,
                      const float* w_scales, float* out) {
  LineVector<int8_t> q(static_cast<size_t>(m * k));
  std::vector<float> x_scales(static_cast<size_t>(m));
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) round_row(x + t * k, k, q.data() + t * k, &x_scales[t]);
  });
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
