// Body of LLM.int8()'s integer product (int8_gemm_stub): int32 dot products of int8 weight rows
// with int8 activations widened to int16; compiled once per CPU capability.
//
// Blocks of 4 tokens x 2 weight rows share every load: per 16 inputs, each row's int8 bytes are
// sign-extended to int16 once and each token's int16 are loaded once, then multiplied pairwise
// and summed into int32 lanes (vpmaddwd, exact: |q| <= 127 gives products under 2^14 and pair
// sums under 2^15, and a row of k inputs stays under 2^31 for k < 2^17); with VNNI (the
// AVX2_VNNI and AVX512_VNNI variants) vpdpwssd does the multiply and the accumulation in one
// instruction. Rows go to the threads in blocks.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "kernels/cpu_kernels.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kTokens = 4;   // tokens per block
constexpr int64_t kRows = 2;     // weight rows per block
constexpr int64_t kRowGrain = 16;

#if defined(CPU_CAPABILITY_AVX512)
using IVec = __m512i;
constexpr int64_t kStep = 32;  // int16 lanes per vector
inline IVec widen(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline IVec load16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline IVec madd_add(IVec acc, IVec a, IVec b) {
#if defined(CPU_CAPABILITY_VNNI)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
inline IVec zero() { return _mm512_setzero_si512(); }
inline int32_t sum(IVec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(CPU_CAPABILITY_AVX2)
using IVec = __m256i;
constexpr int64_t kStep = 16;
inline IVec widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec load16(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline IVec madd_add(IVec acc, IVec a, IVec b) {
#if defined(CPU_CAPABILITY_VNNI)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
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

// out[t, o] for tokens [t0, t0 + T) and rows [o0, o0 + R).
template <int T, int R>
void block(const int16_t* x, const int8_t* w, int64_t k, int64_t t0, int64_t o0, int64_t n,
           int32_t* out) {
  int32_t tail[T][R] = {};
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  IVec acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = zero();
  for (; i + kStep <= k; i += kStep) {
    IVec wr[R];
    for (int r = 0; r < R; ++r) wr[r] = widen(w + (o0 + r) * k + i);
    for (int t = 0; t < T; ++t) {
      const IVec xt = load16(x + (t0 + t) * k + i);
      for (int r = 0; r < R; ++r) acc[t][r] = madd_add(acc[t][r], xt, wr[r]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) tail[t][r] = sum(acc[t][r]);
#endif
  for (; i < k; ++i) {
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        tail[t][r] += static_cast<int32_t>(x[(t0 + t) * k + i]) * w[(o0 + r) * k + i];
      }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) out[(t0 + t) * n + o0 + r] = tail[t][r];
}

template <int R>
void rows_block(const int16_t* x, int64_t m, const int8_t* w, int64_t k, int64_t o0, int64_t n,
                int32_t* out) {
  int64_t t = 0;
  for (; t + kTokens <= m; t += kTokens) block<kTokens, R>(x, w, k, t, o0, n, out);
  for (; t < m; ++t) block<1, R>(x, w, k, t, o0, n, out);
}

void int8_gemm_impl(const int16_t* x, int64_t m, const int8_t* w, int64_t n, int64_t k,
                    int32_t* out) {
  const int64_t blocks = (n + kRows - 1) / kRows;
  at::parallel_for(0, blocks, kRowGrain / kRows, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * kRows;
      if (o0 + kRows <= n) {
        rows_block<kRows>(x, m, w, k, o0, n, out);
      } else {
        for (int64_t o = o0; o < n; ++o) rows_block<1>(x, m, w, k, o, n, out);
      }
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(int8_gemm_stub, &int8_gemm_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
