#pragma once
// Writes the keys and values of new tokens into a (paged or contiguous) KV cache.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// key_cache[slot] = key[t], value_cache[slot] = value[t] for slot = slot_mapping[t] >= 0
/// (slot = block_id * block_size + offset; -1 means padding, not written).
/// key, value: [num_tokens, num_kv_heads, head_dim] (rows may be strided, heads contiguous).
/// key_cache, value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim]. When
///   value_cache is key_cache (an MLA latent cache, one entry per token) only the keys are
///   written and `value` is not read.
/// slot_mapping: int64 [num_tokens]. Throws if a slot is outside the cache.
void kv_cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping);

}  // namespace kvserve::ops
