#pragma once
// Helpers for kernel bodies compiled per CPU capability: fp32 vectors loaded from and stored to
// fp32 / bf16 / fp16 memory, and a dtype switch. Include only from `*_cpu_kernel.cpp` files.

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {

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

/// Converts n fp32 elements to T.
template <typename T>
inline void convert_from_float(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) store_from_float(dst + i, Vec::loadu(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
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
