#pragma once
// Argument checks of kv_cache_copy_blocks shared by its CPU and CUDA launchers: the tensors'
// shapes, and the pairs' values wherever the host holds them.

#include <ATen/core/Tensor.h>

#include <unordered_set>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// The caches (one shape, dtype and device, contiguous) and block_mapping's shape and dtype.
inline void check_kv_cache_copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                                       const at::Tensor& block_mapping) {
  TORCH_CHECK(!key_caches.empty() &&
                  (value_caches.empty() || key_caches.size() == value_caches.size()),
              "kv_cache_copy_blocks: need one key cache per layer and one value cache per layer "
              "or none, got ", key_caches.size(), " and ", value_caches.size());
  const at::Tensor& first = key_caches[0];
  TORCH_CHECK(first.dim() == 4, "kv_cache_copy_blocks: caches must be [num_blocks, block_size, "
              "heads, head_dim], got ", first.sizes());
  for (const auto* list : {&key_caches, &value_caches}) {
    for (const at::Tensor& cache : *list) {
      TORCH_CHECK(cache.sizes() == first.sizes() && cache.is_contiguous(),
                  "kv_cache_copy_blocks: every cache must be contiguous ", first.sizes(), ", got ",
                  cache.sizes());
      check_like("kv_cache_copy_blocks", "cache", cache, first);
    }
  }
  check_contiguous("kv_cache_copy_blocks", "block_mapping", block_mapping, at::kLong);
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "kv_cache_copy_blocks: block_mapping must be [num_pairs, 2], got ",
              block_mapping.sizes());
}

/// Every id inside the pool, no destination twice, no destination that is also a source.
/// pairs: host memory, [num_pairs, 2].
inline void check_block_pairs(const int64_t* pairs, int64_t num_pairs, int64_t num_blocks) {
  std::unordered_set<int64_t> sources, destinations;
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src = pairs[2 * i], dst = pairs[2 * i + 1];
    TORCH_CHECK(src >= 0 && src < num_blocks && dst >= 0 && dst < num_blocks,
                "kv_cache_copy_blocks: pair (", src, ", ", dst, ") is outside the pool of ",
                num_blocks, " blocks");
    TORCH_CHECK(destinations.insert(dst).second, "kv_cache_copy_blocks: block ", dst,
                " is a destination twice");
    sources.insert(src);
  }
  for (int64_t dst : destinations) {
    TORCH_CHECK(!sources.count(dst), "kv_cache_copy_blocks: block ", dst,
                " is both a source and a destination");
  }
}

}  // namespace kvserve::ops
