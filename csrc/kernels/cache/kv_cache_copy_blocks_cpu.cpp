// CPU implementation of kv_cache_copy_blocks: one memcpy per (layer, cache, pair).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "kernels/cache/kv_cache_copy_blocks.h"
#include "kernels/cache/kv_cache_copy_blocks_checks.h"

namespace kvserve::ops {
namespace {

void kv_cache_copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches,
                              const at::Tensor& block_mapping) {
  check_kv_cache_copy_blocks(key_caches, value_caches, block_mapping);
  const at::Tensor& first = key_caches[0];
  const int64_t num_pairs = block_mapping.size(0);
  const int64_t num_blocks = first.size(0);
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  check_block_pairs(pairs, num_pairs, num_blocks);

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
