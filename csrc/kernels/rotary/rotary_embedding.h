#pragma once
// Rotary position embedding (RoPE), applied in place to queries and keys, optionally after an
// RMSNorm of each head (Qwen3's and Gemma 3's q_norm / k_norm, fused: one pass, no copies).

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// Rotates query [num_tokens, num_heads * head_dim] and key [num_tokens, num_kv_heads * head_dim]
/// (rows may be strided views of a fused qkv tensor) at positions [num_tokens] (int64).
/// cos_sin_cache: fp32 [max_position, rot_dim], cosines then sines; rot_dim <= head_dim (the
/// remaining dims pass through). is_neox: rotate-half (Hugging Face Llama); else interleaved pairs
/// (GPT-J, llama2.c). Throws if a position is outside [0, max_position).
/// query_norm / key_norm: [head_dim], of the query's dtype or fp32. Given, every head of that
/// side is first RMS-normalized, head = head * rsqrt(mean(head^2) + norm_epsilon) * weight
/// (fp32, one rounding to the dtype, exactly as rms_norm over [num_tokens * heads, head_dim]),
/// then rotated: the result equals rms_norm followed by rotary_embedding.
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_dim, const at::Tensor& cos_sin_cache, bool is_neox,
                      const std::optional<at::Tensor>& query_norm = std::nullopt,
                      const std::optional<at::Tensor>& key_norm = std::nullopt,
                      double norm_epsilon = 1e-6);

}  // namespace kvserve::ops
