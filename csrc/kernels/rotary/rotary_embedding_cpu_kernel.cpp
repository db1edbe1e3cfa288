// Rotary position embedding body (neox rotate-half and interleaved pairs); per CPU capability.
#include <ATen/Parallel.h>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

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

void rotary_embedding_impl(c10::ScalarType dtype, const int64_t* positions, void* query,
                           int64_t query_stride, int64_t num_heads, void* key, int64_t key_stride,
                           int64_t num_kv_heads, int64_t head_dim, const float* cos_sin_cache,
                           int64_t rot_dim, int64_t num_tokens, bool is_neox) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    auto* q = static_cast<scalar_t*>(query);
    auto* k = static_cast<scalar_t*>(key);
    at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_sin_cache + positions[t] * rot_dim;
        const float* sin = cos + rot_dim / 2;
        for (int64_t h = 0; h < num_heads; ++h) {
          rotate_head(q + t * query_stride + h * head_dim, cos, sin, rot_dim, is_neox);
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          rotate_head(k + t * key_stride + h * head_dim, cos, sin, rot_dim, is_neox);
        }
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(rotary_embedding_stub, &rotary_embedding_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
