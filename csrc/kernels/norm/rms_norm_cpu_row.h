#pragma once
// One row of RMSNorm, vectorized per CPU capability: shared by rms_norm's bodies and
// rotary_embedding's per-head norm, so both round alike. Include only from `*_cpu_kernel.cpp`.

#include <cmath>
#include <cstdint>

#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {

/// rsqrt(mean(x^2) + eps) over `hidden` elements, accumulated in fp32.
template <typename T>
inline float inverse_rms(const T* x, int64_t hidden, float eps) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= hidden; i += Vec::size()) {
    const Vec v = load_as_float(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < hidden; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
}

/// out = x * inv * weight, one rounding to T (out may be x).
template <typename T, typename W>
inline void normalize_row(T* out, const T* x, const W* weight, int64_t hidden, float inv) {
  const Vec scale(inv);
  int64_t i = 0;
  for (; i + Vec::size() <= hidden; i += Vec::size()) {
    store_from_float(out + i, load_as_float(x + i) * scale * load_as_float(weight + i));
  }
  for (; i < hidden; ++i) {
    out[i] = static_cast<T>(static_cast<float>(x[i]) * inv * static_cast<float>(weight[i]));
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
