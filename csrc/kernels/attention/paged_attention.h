#pragma once
// Attention of variable-length query runs over a paged KV cache: prefill, prefill after a cached
// prefix, chunked prefill and decode through one interface.

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// For each sequence b, its queries are tokens [query_start_loc[b], query_start_loc[b+1]) of
/// `query` and are the last positions of its context of seq_lens[b] tokens, whose keys/values
/// are already in the cache (write them with kv_cache_write first). Query i of a run of q tokens
/// sits at position seq_lens[b] - q + i and attends causally to positions <= its own, limited to
/// the last `sliding_window` positions when sliding_window > 0. Scores are scale * q.k, soft-capped
/// as c * tanh(s / c) when logit_softcap > 0; softmax and accumulation are fp32.
/// query: [num_tokens, num_heads, head_dim]; out: [num_tokens, num_heads, value_head_dim] (rows
///   may be strided; heads contiguous).
/// key_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim];
/// value_cache: contiguous [num_blocks, block_size, num_kv_heads, value_row] with
///   value_row >= value_head_dim: a value is the first value_head_dim elements of its row. Plain
///   attention has value_row = value_head_dim (often = head_dim); multi-head latent attention
///   passes the latent cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim] as both caches
///   with value_head_dim = kv_lora_rank (MQA over latents, the absorbed form), and each latent is
///   read once for both. num_heads must be a multiple of num_kv_heads (GQA/MQA).
/// query_start_loc: int32 [num_seqs + 1]; seq_lens: int32 [num_seqs];
/// block_tables: int32 [num_seqs, max_blocks_per_seq], position p of sequence b lives in block
///   block_tables[b][p / block_size] at offset p % block_size.
/// The caches hold entries of the query's dtype, or int8 / float8_e4m3fn entries with their
///   fp32 scales key_scale / value_scale [num_blocks, block_size, num_kv_heads], as
///   kv_cache_write stores them: a row's entries times its scale are its values, dequantized in
///   registers as the rows are read (a latent cache passes its scales as both).
/// sinks: fp32 [num_heads], a learned logit per query head (gpt-oss's attention sinks) that
///   joins each query's softmax as one more score with no value: it takes its share of the
///   probability and adds nothing to the output (absent: none).
/// Throws on inconsistent metadata (a run longer than its context, a block id outside the cache,
/// a context longer than its block table).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
                     int64_t sliding_window, double logit_softcap,
                     const std::optional<at::Tensor>& key_scale = std::nullopt,
                     const std::optional<at::Tensor>& value_scale = std::nullopt,
                     const std::optional<at::Tensor>& sinks = std::nullopt);

}  // namespace kvserve::ops
