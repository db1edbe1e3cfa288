#pragma once
// Rotary position embedding (RoPE), applied in place to queries and keys.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// Rotates query [num_tokens, num_heads * head_dim] and key [num_tokens, num_kv_heads * head_dim]
/// (rows may be strided views of a fused qkv tensor) at positions [num_tokens] (int64).
/// cos_sin_cache: fp32 [max_position, rot_dim], cosines then sines; rot_dim <= head_dim (the
/// remaining dims pass through). is_neox: rotate-half (Hugging Face Llama); else interleaved pairs
/// (GPT-J, llama2.c). Throws if a position is outside [0, max_position).
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_dim, const at::Tensor& cos_sin_cache, bool is_neox);

}  // namespace kvserve::ops
