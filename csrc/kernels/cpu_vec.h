#pragma once
// Helpers for kernel bodies compiled per CPU capability: fp32 vectors loaded from and stored to
// fp32 / bf16 / fp16 memory, int8 / fp8 rows dequantized to fp32, and a dtype switch. Include
// only from `*_cpu_kernel.cpp` files.

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "kernels/cpu_dispatch.h"
#include "kernels/cpu_kernels.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
/// stream_prefetch(), read once when the library loads (a load, not a call, in the loops).
inline const StreamPrefetch kStreamPrefetch = stream_prefetch();

/// Asks for the cache line at `line` of a weight read once a call, as stream_prefetch() says
/// (no fault past the weight's end).
inline void prefetch_stream(const void* line) {
  const char* p = static_cast<const char*>(line);
  if (kStreamPrefetch == StreamPrefetch::kNonTemporal) {
    _mm_prefetch(p, _MM_HINT_NTA);
  } else {
    _mm_prefetch(p, _MM_HINT_T1);
  }
}
#endif

/// std::allocator's alignment for T, raised to a cache line, for buffers that kernels load 64
/// bytes at a time (AVX-512): from a buffer that starts off a line (std::vector's 16-byte
/// alignment: three allocations in four) every such load straddles two lines, which halved the
/// speed of the int8-input row kernels in some calls.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

using Vec = at::vec::Vectorized<float>;

/// Loads Vec::size() elements of T as fp32.
template <typename T>
inline Vec load_as_float(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

/// Stores Vec::size() fp32 lanes as T (round to nearest even for bf16/fp16).
template <typename T>
inline void store_from_float(T* dst, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(dst);
  } else {
    at::vec::convert_from_float<T>(v, v).store(dst, Vec::size());
  }
}

/// Sum of a[i] * b[i] over n fp32 elements, vectorized.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

/// y[i] += alpha * x[i] over n fp32 elements.
inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  const Vec a(alpha);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    at::vec::fmadd(a, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}

/// Converts n elements of T to fp32.
template <typename T>
inline void convert_to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) load_as_float(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

/// Row o's scales and zeros (null without) of a quantized weight [n, groups] as fp32: pointers
/// into the weight's own where they are fp32, else widened from fp16 into `buffer`
/// (2 * groups floats from quantized_row_params_buffer): the few bytes a row's parameters take,
/// next to its q. A shared zero is the buffer's second half, filled once by
/// quantized_row_params_buffer. Two-level scales (QuantizedWeight::super_scales) come as each
/// group's scale and, with zeros, `offsets`, each group's zero term (zero * scale in the
/// one-level form, which these do not have: a K-quant sub-block's scale may be 0 where its
/// minimum is not), zeros then null.
struct QuantizedRowParams {
  const float* scales;
  const float* zeros;
  const float* offsets = nullptr;
};

/// out[s * S + j] = factors[s] * ints[s * S + j] for `supers` super-blocks of S groups (factors
/// fp32, widened first where fp16): with AVX2, eight groups a vector where S is a multiple of 8
/// (the K-quants' 8 and 16, as constants); written out, as int8 pointers may alias the output
/// for the compiler.
template <int64_t kS>
inline void widen_two_level(const float* factors, const int8_t* ints, int64_t supers, int64_t S,
                            float* out) {
  if constexpr (kS > 0) S = kS;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if (S % 8 == 0) {
    for (int64_t s = 0; s < supers; ++s) {
      const __m256 f = _mm256_broadcast_ss(factors + s);
      for (int64_t j = s * S; j < (s + 1) * S; j += 8) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ints + j));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      }
    }
    return;
  }
#endif
  for (int64_t s = 0; s < supers; ++s) {
    for (int64_t j = s * S; j < (s + 1) * S; ++j) out[j] = factors[s] * static_cast<float>(ints[j]);
  }
}

/// The two-level scales of row o: buffer[g] = super_scales[o, g / S] * scales[o, g] and, with
/// zeros, buffer[groups + g] = super_mins[o, g / S] * zeros[o, g] (S = super_group).
template <typename P>
inline QuantizedRowParams two_level_row_params(const QuantizedWeight& w, int64_t o,
                                               int64_t groups, float* buffer) {
  const int64_t S = w.super_group, supers = groups / S;
  const auto widen = [&](const void* factors, const void* ints, float* out) {
    const P* f = static_cast<const P*>(factors) + o * supers;
    const int8_t* q = static_cast<const int8_t*>(ints) + o * groups;
    for (int64_t s0 = 0; s0 < supers; s0 += 64) {  // 64 super-blocks' factors at a time
      const int64_t count = std::min<int64_t>(64, supers - s0);
      float wide[64];
      if constexpr (std::is_same_v<P, float>) {
        std::copy_n(f + s0, count, wide);
      } else {
        int64_t s = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
        for (; s + 8 <= count; s += 8) {
          _mm256_storeu_ps(wide + s, _mm256_cvtph_ps(_mm_loadu_si128(
                                         reinterpret_cast<const __m128i*>(f + s0 + s))));
        }
#endif
        for (; s < count; ++s) wide[s] = static_cast<float>(f[s0 + s]);
      }
      const int8_t* qs = q + s0 * S;
      float* os = out + s0 * S;
      switch (S) {
        case 8: widen_two_level<8>(wide, qs, count, S, os); break;
        case 16: widen_two_level<16>(wide, qs, count, S, os); break;
        default: widen_two_level<0>(wide, qs, count, S, os);
      }
    }
  };
  widen(w.super_scales, w.scales, buffer);
  if (w.zeros == nullptr) return {buffer, nullptr};
  widen(w.super_mins, w.zeros, buffer + groups);
  return {buffer, nullptr, buffer + groups};
}

inline QuantizedRowParams quantized_row_params(const QuantizedWeight& w, int64_t o,
                                               int64_t groups, float* buffer) {
  if (w.super_scales != nullptr) {
    return w.half_params ? two_level_row_params<c10::Half>(w, o, groups, buffer)
                         : two_level_row_params<float>(w, o, groups, buffer);
  }
  const float* scales = static_cast<const float*>(w.scales) + o * groups;
  if (w.half_params) {
    convert_to_float(static_cast<const c10::Half*>(w.scales) + o * groups, buffer, groups);
    scales = buffer;
  }
  if (w.zeros == nullptr) return {scales, nullptr};
  if (w.shared_zero) return {scales, buffer + groups};
  if (!w.half_params) return {scales, static_cast<const float*>(w.zeros) + o * groups};
  convert_to_float(static_cast<const c10::Half*>(w.zeros) + o * groups, buffer + groups, groups);
  return {scales, buffer + groups};
}

/// Scratch for quantized_row_params of `rows` rows at once (2 * groups floats a row, none where
/// the weight's parameters are fp32 and its zeros its own), each row's zeros set to a shared zero.
inline std::vector<float> quantized_row_params_buffer(const QuantizedWeight& w, int64_t groups,
                                                      int64_t rows = 1) {
  if (!w.half_params && !w.shared_zero && w.super_scales == nullptr) return {};
  std::vector<float> buffer(2 * groups * rows);
  if (w.shared_zero) {
    const float zero = w.half_params ? static_cast<float>(*static_cast<const c10::Half*>(w.zeros))
                                     : *static_cast<const float*>(w.zeros);
    for (int64_t r = 0; r < rows; ++r) {
      std::fill_n(buffer.data() + (2 * r + 1) * groups, groups, zero);
    }
  }
  return buffer;
}

/// Converts n fp32 elements to T.
template <typename T>
inline void convert_from_float(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) store_from_float(dst + i, Vec::loadu(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

/// dst [m, n] = y [m, n] (fp32, contiguous; the bias is added in place) + bias [n] (nullable),
/// rounded to T: how a GEMV body that accumulates in fp32 writes its output.
template <typename T>
inline void add_bias_and_store(float* y, const T* bias, T* dst, int64_t m, int64_t n) {
  for (int64_t t = 0; t < m; ++t) {
    float* row = y + t * n;
    if (bias != nullptr) {
      for (int64_t j = 0; j < n; ++j) row[j] += static_cast<float>(bias[j]);
    }
    convert_from_float(row, dst + t * n, n);
  }
}

/// dst[i] = scale * src[i] over n int8 elements.
inline void dequantize_int8(const int8_t* src, float scale, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 s = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s));
  }
#endif
  for (; i < n; ++i) dst[i] = scale * static_cast<float>(src[i]);
}

/// The value of an fp8 E4M3 byte / 256: the fp16 with the same sign and the byte's exponent and
/// mantissa bits one place lower (exact, subnormals included, no branches). The NaN bytes
/// 0x7f / 0xff decode as +-480 / 256.
inline float fp8_e4m3_over_256(uint8_t b) {
  const auto bits = static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

/// dst[i] = scale * e4m3(src[i]) over n fp8 E4M3 bytes, decoded as fp8_e4m3_over_256 (the 256
/// goes into the scale).
inline void dequantize_fp8_e4m3(const uint8_t* src, float scale, float* dst, int64_t n) {
  const float s256 = scale * 256.0f;
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 s = _mm512_set1_ps(s256);
  const __m256i sign = _mm256_set1_epi16(static_cast<int16_t>(0x8000));
  const __m256i rest = _mm256_set1_epi16(0x7f);
  for (; i + 16 <= n; i += 16) {
    const __m256i b =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 8), sign),
                                      _mm256_slli_epi16(_mm256_and_si256(b, rest), 7));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), s));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 s = _mm256_set1_ps(s256);
  const __m128i sign = _mm_set1_epi16(static_cast<int16_t>(0x8000));
  const __m128i rest = _mm_set1_epi16(0x7f);
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), sign),
                                   _mm_slli_epi16(_mm_and_si128(b, rest), 7));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
  }
#endif
  for (; i < n; ++i) dst[i] = s256 * fp8_e4m3_over_256(src[i]);
}

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu

/// Runs `body` with `scalar_t` bound to float, c10::BFloat16 or c10::Half.
#define KVSERVE_DISPATCH_FLOATING(dtype, ...)                                             \
  [&] {                                                                                   \
    switch (dtype) {                                                                      \
      case c10::ScalarType::Float: { using scalar_t = float; return __VA_ARGS__(); }      \
      case c10::ScalarType::BFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
      case c10::ScalarType::Half: { using scalar_t = c10::Half; return __VA_ARGS__(); }   \
      default: TORCH_CHECK(false, "kvserve: unsupported dtype ", dtype);                   \
    }                                                                                     \
  }()
