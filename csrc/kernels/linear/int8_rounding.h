// fp32 values rounded to int8 in vector code, as the integer-dot kernels' contracts state:
// q = clamp(round_half_even(x * inverse), -127, 127) (quantized_linear's int8 inputs, per block)
// or round_half_even(x / divisor) (LLM.int8()'s, per token, dividing as its reference does).
// `vcvtps2dq` rounds half to even under the default rounding mode, as `nearbyint` does, and a
// vector multiply or divide rounds each lane as the scalar one does, so the results are the
// scalar code's bit for bit. Included by the kernel files, once per CPU capability; without AVX2
// the loops are scalar.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

/// max |x[j]| over n values; `finite` false if one is a NaN or an infinity (the maximum is then
/// meaningless).
inline float abs_max(const float* x, int64_t n, bool& finite) {
  int64_t j = 0;
  float amax = 0.0f;
  finite = true;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 infinity = _mm256_set1_ps(INFINITY);
  __m256 top = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (; j + 8 <= n; j += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + j), magnitude);
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, infinity, _CMP_LT_OQ));  // false for NaN
    top = _mm256_max_ps(top, a);
  }
  finite = _mm256_movemask_ps(ok) == 0xff;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
  for (; j < n; ++j) {
    finite = finite && std::isfinite(x[j]);
    amax = std::max(amax, std::fabs(x[j]));
  }
  return amax;
}

/// q[j] = clamp(round_half_even(x[j] * factor), -127, 127), or x[j] / factor with kDivide, for n
/// finite values; returns the sum of q.
template <bool kDivide>
inline int32_t round_to_int8(const float* x, int64_t n, float factor, int8_t* q) {
  int64_t j = 0;
  int32_t sum = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  const __m256 f = _mm256_set1_ps(factor);
  const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
  __m256i total = _mm256_setzero_si256();
  const auto round8 = [&](int64_t at) {
    const __m256 v = _mm256_loadu_ps(x + at);
    const __m256 scaled = kDivide ? _mm256_div_ps(v, f) : _mm256_mul_ps(v, f);
    const __m256i r = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(scaled), low), high);
    total = _mm256_add_epi32(total, r);
    return r;
  };
  for (; j + 32 <= n; j += 32) {
    const __m256i r0 = round8(j), r1 = round8(j + 8), r2 = round8(j + 16), r3 = round8(j + 24);
    // packs works within 128-bit halves: the dwords come out in the order 0 4 1 5 2 6 3 7.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r0, r1),
                                             _mm256_packs_epi32(r2, r3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j),
                        _mm256_permutevar8x32_epi32(bytes,
                                                    _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0)));
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  sum = _mm_cvtsi128_si32(s);
#endif
  for (; j < n; ++j) {
    const float scaled = kDivide ? x[j] / factor : x[j] * factor;
    q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(scaled), -127.0f, 127.0f));
    sum += q[j];
  }
  return sum;
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
