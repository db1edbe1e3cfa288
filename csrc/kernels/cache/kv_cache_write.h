#pragma once
// Writes the keys and values of new tokens into a (paged or contiguous) KV cache, as they are or
// quantized to int8 / fp8 E4M3 with one scale per token and KV head.

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// key_cache[slot] = key[t], value_cache[slot] = value[t] for slot = slot_mapping[t] >= 0
/// (slot = block_id * block_size + offset; -1 means padding, not written).
/// key, value: [num_tokens, num_kv_heads, head_dim] (rows may be strided, heads contiguous).
/// key_cache, value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim]. When
///   value_cache is key_cache (an MLA latent cache, one entry per token) only the keys are
///   written and `value` is not read.
/// slot_mapping: int64 [num_tokens]. Throws if a slot is outside the cache.
///
/// Quantized caches: key_cache and value_cache int8 or float8_e4m3fn, with key_scale and
/// value_scale fp32 [num_blocks, block_size, num_kv_heads] (a latent cache passes its one scale
/// tensor as both). Each (token, KV head) row x of head_dim entries is stored as q with
///   int8: s = max|x| / 127, q = round_half_even(x / s) (all 0 and s = 0 for a zero row);
///   fp8:  s = max|x| / 448, q = e4m3(x / s) (round to nearest even),
/// and s at the row's place in the scales, so that x ~ q * s. A scale per row (not per block)
/// means that a token's entry never changes once written: appending to a block, sharing it
/// through the prefix cache and copying it on write need no rescaling.
void kv_cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& key_scale = std::nullopt,
                    const std::optional<at::Tensor>& value_scale = std::nullopt);

}  // namespace kvserve::ops
