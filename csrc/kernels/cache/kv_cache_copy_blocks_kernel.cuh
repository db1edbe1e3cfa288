#pragma once
// CUDA body of kv_cache_copy_blocks (contract: kv_cache_copy_blocks.h): one block per (pair,
// cache tensor), threads striding over the block's elements in 16-byte units where the size
// allows. Raw pointers only, no torch headers.

#include <cstdint>

namespace kvserve::cuda {

/// Grid (num_pairs, layers), any block size: copies block src to block dst of layer l's caches
/// for (src, dst) = block_mapping[pair], `block_elems` elements of T (a 16-byte or narrower unit)
/// each. Ids outside [0, num_blocks) are skipped.
template <typename T>
__global__ void kv_cache_copy_blocks_kernel(T* const* caches, const int64_t* block_mapping,
                                            int64_t num_blocks, int64_t block_elems) {
  const int64_t src = block_mapping[2 * blockIdx.x], dst = block_mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  T* cache = caches[blockIdx.y];
  const T* from = cache + src * block_elems;
  T* to = cache + dst * block_elems;
  for (int64_t i = threadIdx.x; i < block_elems; i += blockDim.x) to[i] = from[i];
}

}  // namespace kvserve::cuda
