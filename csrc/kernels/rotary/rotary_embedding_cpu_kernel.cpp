// Rotary position embedding body (neox rotate-half and interleaved pairs, optionally after an
// RMSNorm of each head); per CPU capability.
#include <ATen/Parallel.h>

#include <type_traits>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"
#include "kernels/norm/rms_norm_cpu_row.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

// Rotates the first rot_dim elements of one head; the rest (partial rotary) stay as they are.
template <typename T>
void rotate_head(T* x, const float* cos, const float* sin, int64_t rot_dim, bool is_neox) {
  const int64_t half = rot_dim / 2;
  if (is_neox) {
    T* x1 = x;
    T* x2 = x + half;
    int64_t i = 0;
    for (; i + Vec::size() <= half; i += Vec::size()) {
      const Vec a = load_as_float(x1 + i), b = load_as_float(x2 + i);
      const Vec c = Vec::loadu(cos + i), s = Vec::loadu(sin + i);
      store_from_float(x1 + i, a * c - b * s);
      store_from_float(x2 + i, b * c + a * s);
    }
    for (; i < half; ++i) {
      const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
      x1[i] = static_cast<T>(a * cos[i] - b * sin[i]);
      x2[i] = static_cast<T>(b * cos[i] + a * sin[i]);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(x[2 * i]), b = static_cast<float>(x[2 * i + 1]);
      x[2 * i] = static_cast<T>(a * cos[i] - b * sin[i]);
      x[2 * i + 1] = static_cast<T>(b * cos[i] + a * sin[i]);
    }
  }
}

// Normalizes (with a norm weight) and rotates `count` heads of head_dim at x.
template <typename T, typename W>
void rotate_heads(T* x, int64_t count, int64_t head_dim, const float* cos, const float* sin,
                  int64_t rot_dim, bool is_neox, const W* norm, float eps) {
  for (int64_t h = 0; h < count; ++h) {
    T* head = x + h * head_dim;
    if (norm) normalize_row(head, head, norm, head_dim, inverse_rms(head, head_dim, eps));
    rotate_head(head, cos, sin, rot_dim, is_neox);
  }
}

template <typename T, typename W>
void rotate_rows(const int64_t* positions, T* q, int64_t query_stride, int64_t num_heads, T* k,
                 int64_t key_stride, int64_t num_kv_heads, int64_t head_dim,
                 const float* cos_sin_cache, int64_t rot_dim, int64_t num_tokens, bool is_neox,
                 const W* query_norm, const W* key_norm, float eps) {
  at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin_cache + positions[t] * rot_dim;
      const float* sin = cos + rot_dim / 2;
      rotate_heads(q + t * query_stride, num_heads, head_dim, cos, sin, rot_dim, is_neox,
                   query_norm, eps);
      rotate_heads(k + t * key_stride, num_kv_heads, head_dim, cos, sin, rot_dim, is_neox,
                   key_norm, eps);
    }
  });
}

void rotary_embedding_impl(c10::ScalarType dtype, const int64_t* positions, void* query,
                           int64_t query_stride, int64_t num_heads, void* key, int64_t key_stride,
                           int64_t num_kv_heads, int64_t head_dim, const float* cos_sin_cache,
                           int64_t rot_dim, int64_t num_tokens, bool is_neox,
                           const void* query_norm, const void* key_norm, bool fp32_norm,
                           float norm_epsilon) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    auto* q = static_cast<scalar_t*>(query);
    auto* k = static_cast<scalar_t*>(key);
    auto run = [&](auto* weight_type) {
      using W = std::remove_pointer_t<decltype(weight_type)>;
      rotate_rows(positions, q, query_stride, num_heads, k, key_stride, num_kv_heads, head_dim,
                  cos_sin_cache, rot_dim, num_tokens, is_neox,
                  static_cast<const W*>(query_norm), static_cast<const W*>(key_norm),
                  norm_epsilon);
    };
    if (fp32_norm) {
      run(static_cast<float*>(nullptr));
    } else {
      run(static_cast<scalar_t*>(nullptr));
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(rotary_embedding_stub, &rotary_embedding_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
