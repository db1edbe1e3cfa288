#pragma once
// CUDA body of rotary_embedding (contract: rotary_embedding.h): one thread block per token,
// threads striding over the (head, pair) rotations of its query and key rows, in place, fp32
// math. Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"

namespace kvserve::cuda {

/// Rotates pair i of the head at x: (i, i + half) for neox rotate-half, else (2i, 2i + 1).
template <typename T>
__device__ inline void rotate_pair(T* x, int64_t i, int64_t half, float c, float s, bool is_neox) {
  const int64_t first = is_neox ? i : 2 * i, second = is_neox ? i + half : 2 * i + 1;
  const float a = to_float(x[first]), b = to_float(x[second]);
  x[first] = from_float<T>(a * c - b * s);
  x[second] = from_float<T>(b * c + a * s);
}

/// Grid (num_tokens), any block size. A position outside [0, max_position) leaves its rows as
/// they are (the host checks positions where it can read them; a kernel must not read past the
/// cache).
template <typename T>
__global__ void rotary_embedding_kernel(const int64_t* positions, T* query, int64_t query_stride,
                                        int64_t num_heads, T* key, int64_t key_stride,
                                        int64_t num_kv_heads, int64_t head_dim,
                                        const float* cos_sin_cache, int64_t rot_dim,
                                        int64_t max_position, bool is_neox) {
  const int64_t t = blockIdx.x;
  const int64_t position = positions[t];
  if (position < 0 || position >= max_position) return;
  const float* cos = cos_sin_cache + position * rot_dim;
  const int64_t half = rot_dim / 2;
  const float* sin = cos + half;
  const int64_t query_pairs = num_heads * half, all_pairs = (num_heads + num_kv_heads) * half;
  for (int64_t p = threadIdx.x; p < all_pairs; p += blockDim.x) {
    const bool is_query = p < query_pairs;
    const int64_t local = is_query ? p : p - query_pairs;
    const int64_t head = local / half, i = local % half;
    T* row = is_query ? query + t * query_stride : key + t * key_stride;
    rotate_pair(row + head * head_dim, i, half, cos[i], sin[i], is_neox);
  }
}

}  // namespace kvserve::cuda
