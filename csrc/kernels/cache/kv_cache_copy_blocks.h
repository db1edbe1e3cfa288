#pragma once
// Copies whole cache blocks, for copy-on-write of a shared, partially filled block.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// For every layer l and pair i: key_caches[l][dst_i] = key_caches[l][src_i], and the same for
/// value_caches, where (src_i, dst_i) = block_mapping[i].
/// key_caches, value_caches: one contiguous [num_blocks, block_size, num_kv_heads, head_dim]
/// tensor per layer, all of one shape and dtype; value_caches is empty for latent (MLA) caches,
/// which hold one entry per token.
/// block_mapping: int64 [num_pairs, 2]. Throws if an id is outside the pool, a destination repeats,
/// or a destination is also a source (the copies would depend on their order).
void kv_cache_copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                          const at::Tensor& block_mapping);

}  // namespace kvserve::ops
