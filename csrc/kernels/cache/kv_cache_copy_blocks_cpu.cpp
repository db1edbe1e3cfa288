// CPU implementation of kv_cache_copy_blocks: one memcpy per (layer, cache, pair).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <unordered_set>

#include "kernels/cache/kv_cache_copy_blocks.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void kv_cache_copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches,
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

  const int64_t num_pairs = block_mapping.size(0);
  const int64_t num_blocks = first.size(0);
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
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

  const int64_t block_bytes = first.numel() / num_blocks * first.element_size();
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  const int64_t per_layer = value_caches.empty() ? 1 : 2;
  // One task per (layer, key-or-value, pair).
  at::parallel_for(0, num_layers * per_layer * num_pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task % num_pairs;
      const int64_t cache = task / num_pairs;  // layer * per_layer + (0 key | 1 value)
      const at::Tensor& t = cache % per_layer == 0 ? key_caches[cache / per_layer]
                                                   : value_caches[cache / per_layer];
      auto* base = static_cast<char*>(t.data_ptr());
      std::memcpy(base + pairs[2 * pair + 1] * block_bytes, base + pairs[2 * pair] * block_bytes,
                  block_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("kv_cache_copy_blocks", &kv_cache_copy_blocks_cpu); }

}  // namespace kvserve::ops
