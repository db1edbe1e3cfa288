#pragma once
// CUDA bodies of rotary_embedding (contract: rotary_embedding.h): in place, fp32 math; a few
// tokens spread each over several blocks (rotary_splits), many take a block each. Without head norms threads stride over the (head, pair) rotations of its
// query and key rows; with them a warp takes a head at a time (its RMS reduced by shuffles, then
// normalized and rotated pair by pair). Raw pointers only, no torch headers; the launcher checks
// shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// Rotates pair i of the head at x: (i, i + half) for neox rotate-half, else (2i, 2i + 1).
template <typename T>
__device__ inline void rotate_pair(T* x, int64_t i, int64_t half, float c, float s, bool is_neox) {
  const int64_t first = is_neox ? i : 2 * i, second = is_neox ? i + half : 2 * i + 1;
  const float a = to_float(x[first]), b = to_float(x[second]);
  x[first] = from_float<T>(a * c - b * s);
  x[second] = from_float<T>(b * c + a * s);
}

/// The cosines of `position` in the cache (its sines follow), or null outside [0, max_position).
__device__ inline const float* cos_row(int64_t position, const float* cos_sin_cache,
                                       int64_t rot_dim, int64_t max_position) {
  return position < 0 || position >= max_position ? nullptr : cos_sin_cache + position * rot_dim;
}

/// Blocks per token (grid.y) for `units` pieces of work a token, `per_block` of them a block at
/// once: a small batch spreads over about 1,024 blocks (a decode step's one token otherwise
/// runs on one multiprocessor, a strided loop's memory round trip after round trip), a large
/// batch keeps one block per token.
inline unsigned int rotary_splits(int64_t num_tokens, int64_t units, int64_t per_block) {
  constexpr int64_t kTargetBlocks = 1024;
  const int64_t needed = (units + per_block - 1) / per_block;
  const int64_t fill = (kTargetBlocks + num_tokens - 1) / num_tokens;
  return static_cast<unsigned int>(needed < fill ? (needed < 1 ? 1 : needed) : fill);
}

/// Threads of a rotary_embedding_kernel block.
constexpr int kRotaryThreads = 128;

/// Grid (num_tokens, rotary_splits(num_tokens, (num_heads + num_kv_heads) * rot_dim / 2,
/// blockDim.x)) or any grid.y, any block size. A position outside [0, max_position) leaves its
/// rows as they are (the host checks positions where it can read them; a kernel must not read
/// past the cache).
template <typename T>
__global__ void rotary_embedding_kernel(const int64_t* positions, T* query, int64_t query_stride,
                                        int64_t num_heads, T* key, int64_t key_stride,
                                        int64_t num_kv_heads, int64_t head_dim,
                                        const float* cos_sin_cache, int64_t rot_dim,
                                        int64_t max_position, bool is_neox) {
  const int64_t t = blockIdx.x;
  const float* cos = cos_row(positions[t], cos_sin_cache, rot_dim, max_position);
  if (!cos) return;
  // Heads x pairs fit an int: 32-bit division (a 64-bit one is a long call on the GPU).
  const int half = static_cast<int>(rot_dim / 2);
  const float* sin = cos + half;
  const int query_pairs = static_cast<int>(num_heads) * half;
  const int all_pairs = static_cast<int>(num_heads + num_kv_heads) * half;
  for (int p = blockIdx.y * blockDim.x + threadIdx.x; p < all_pairs;
       p += blockDim.x * gridDim.y) {
    const bool is_query = p < query_pairs;
    const int local = is_query ? p : p - query_pairs;
    const int head = local / half, i = local % half;
    T* row = is_query ? query + t * query_stride : key + t * key_stride;
    rotate_pair(row + head * head_dim, i, half, cos[i], sin[i], is_neox);
  }
}

/// Threads a block of rotary_embedding_normed_kernel for `heads` query and key heads: a warp
/// per head, at most 8 warps.
inline int rotary_normed_threads(int64_t heads) {
  return 32 * static_cast<int>(heads < 1 ? 1 : heads < 8 ? heads : 8);
}

/// Grid (num_tokens, rotary_splits(num_tokens, heads, warps a block)) or any grid.y, block a
/// multiple of 32. Each head of the query (with query_norm) and of
/// the key (with key_norm; a null weight leaves that side unnormalized) becomes
/// round(x * rsqrt(mean(x^2) + epsilon) * w), then is rotated from those rounded values, as
/// rms_norm then rotary_embedding do. W: T or float. A lane reads back only the entries it
/// writes, after the warp's reduction has consumed every lane's reads: no barrier needed.
template <typename T, typename W>
__global__ void rotary_embedding_normed_kernel(const int64_t* positions, T* query,
                                               int64_t query_stride, int64_t num_heads, T* key,
                                               int64_t key_stride, int64_t num_kv_heads,
                                               int64_t head_dim, const float* cos_sin_cache,
                                               int64_t rot_dim, int64_t max_position,
                                               bool is_neox, const W* query_norm,
                                               const W* key_norm, float epsilon) {
  const int64_t t = blockIdx.x;
  const float* cos = cos_row(positions[t], cos_sin_cache, rot_dim, max_position);
  if (!cos) return;
  const int64_t half = rot_dim / 2;
  const float* sin = cos + half;
  const int lane = threadIdx.x % 32;
  const int64_t warps = blockDim.x / 32;
  for (int64_t h = blockIdx.y * warps + threadIdx.x / 32; h < num_heads + num_kv_heads;
       h += warps * gridDim.y) {
    const bool is_query = h < num_heads;
    T* x = is_query ? query + t * query_stride + h * head_dim
                    : key + t * key_stride + (h - num_heads) * head_dim;
    const W* w = is_query ? query_norm : key_norm;
    float scale = 1.0f;
    if (w) {
      float sum = 0.0f;
      for (int64_t i = lane; i < head_dim; i += 32) {
        const float v = to_float(x[i]);
        sum += v * v;
      }
      scale = rsqrtf(warp_sum(sum) / static_cast<float>(head_dim) + epsilon);
    }
    // The normalized entry i, rounded to T as rms_norm stores it.
    auto normed = [&](int64_t i) {
      return w ? to_float(from_float<T>(to_float(x[i]) * scale * to_float(w[i]))) : to_float(x[i]);
    };
    for (int64_t i = lane; i < half; i += 32) {
      const int64_t first = is_neox ? i : 2 * i, second = is_neox ? i + half : 2 * i + 1;
      const float a = normed(first), b = normed(second);
      x[first] = from_float<T>(a * cos[i] - b * sin[i]);
      x[second] = from_float<T>(b * cos[i] + a * sin[i]);
    }
    if (w) {
      for (int64_t i = rot_dim + lane; i < head_dim; i += 32) x[i] = from_float<T>(normed(i));
    }
  }
}

}  // namespace kvserve::cuda
