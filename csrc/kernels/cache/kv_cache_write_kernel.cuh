#pragma once
// CUDA body of kv_cache_write (contract: kv_cache_write.h): one block per (token, KV head) row
// and per cache (key, value); a plain cache copies the row, a quantized one reduces max|x| over
// the block, then stores the scale and the entries. Raw pointers only, no torch headers.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// Threads a block of kv_cache_write_kernel takes for rows of `head_dim` entries.
inline int kv_cache_write_threads(int64_t head_dim) {
  return head_dim >= 256 ? 256 : head_dim > 64 ? 128 : 64;
}

/// Grid (num_tokens, num_kv_heads, 2 or 1: key then value; 1 for a latent cache), block a
/// multiple of 32 (kv_cache_write_threads). Rows of key/value: [num_tokens, heads, head_dim] with token strides. Slot -1
/// is padding; a slot outside [0, num_slots) is skipped (the host checks slots where it can read
/// them; a kernel must not write past the cache).
template <typename T, KVFormat F>
__global__ void kv_cache_write_kernel(const T* key, int64_t key_stride, const T* value,
                                      int64_t value_stride, typename KVEntry<T, F>::type* key_cache,
                                      typename KVEntry<T, F>::type* value_cache, float* key_scale,
                                      float* value_scale, const int64_t* slot_mapping,
                                      int64_t num_slots, int64_t heads, int64_t head_dim) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;
  const bool is_key = blockIdx.z == 0;
  const T* x = (is_key ? key + t * key_stride : value + t * value_stride) + h * head_dim;
  const int64_t row = slot * heads + h;  // the row's index in the cache and in the scales
  auto* dst = (is_key ? key_cache : value_cache) + row * head_dim;
  if constexpr (F == KVFormat::kPlain) {
    for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) dst[i] = x[i];
  } else {
    float amax = 0.0f;
    for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
      amax = fmaxf(amax, fabsf(to_float(x[i])));
    }
    amax = block_max(amax, scratch);
    const float s = amax / (F == KVFormat::kInt8 ? 127.0f : 448.0f);
    for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
      const float v = s > 0.0f ? to_float(x[i]) / s : 0.0f;
      if constexpr (F == KVFormat::kInt8) {
        dst[i] = static_cast<int8_t>(fminf(fmaxf(rintf(v), -127.0f), 127.0f));
      } else {
        dst[i] = __nv_fp8_e4m3(fminf(fmaxf(v, -448.0f), 448.0f));
      }
    }
    if (threadIdx.x == 0) (is_key ? key_scale : value_scale)[row] = s;
  }
}

}  // namespace kvserve::cuda
