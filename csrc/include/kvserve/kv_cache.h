#pragma once
// The contiguous, pre-allocated KV cache of the original minimal API (kvserve.compat): one fixed buffer per layer, one row
// per sequence, filled left to right. The paged cache (PagedKVCache) is its general sibling; a
// contiguous cache is the paged layout with one block per row, so the same kernels serve both.

#include <ATen/core/Tensor.h>

#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/causal_lm.h"
#include "kvserve/kv_cache_layout.h"
#include "kvserve/model_config.h"

namespace kvserve {

/// One layer's key and value buffers [max_batch_size, max_seq_len, num_kv_heads, head_dim] plus
/// how many tokens each batch row holds; of the model's dtype, or int8 / fp8 with fp32 scales
/// beside them (kv_cache_write.h).
class KVCache {
 public:
  /// Allocates (uninitialised) buffers. Throws std::invalid_argument on non-positive sizes.
  KVCache(int64_t max_batch_size, int64_t max_seq_len, int64_t num_kv_heads, int64_t head_dim,
          at::ScalarType dtype, at::Device device);

  /// One layer's cache of `layout`: key [max_batch_size, max_seq_len, num_kv_heads, head_dim]
  /// and value [..., value_head_dim], or (latent, MLA) one buffer that is both.
  KVCache(int64_t max_batch_size, int64_t max_seq_len, const KVCacheLayout& layout,
          at::ScalarType dtype, at::Device device);

  /// One cache per layer for a model of this config (its K/V heads, or its MLA latents).
  static std::vector<KVCache> for_model(int64_t max_batch_size, int64_t max_seq_len,
                                        const ModelConfig& config, at::ScalarType dtype,
                                        at::Device device);

  /// One cache per layer, all of the given shape.
  static std::vector<KVCache> from_model_config(int64_t max_batch_size, int64_t max_seq_len,
                                                int64_t num_layers, int64_t num_kv_heads,
                                                int64_t head_dim, at::ScalarType dtype,
                                                at::Device device);

  /// Forgets the contents of every row (lengths back to 0); the buffers stay allocated.
  void reset();

  /// [max_batch_size, max_seq_len, num_kv_heads, head_dim]
  const at::Tensor& key() const { return key_; }
  const at::Tensor& value() const { return value_; }
  /// The paged view used by attention: row b is block b of max_seq_len tokens.
  LayerKVCache layer_view() const { return {key_, value_, 0, key_scale_, value_scale_}; }

  /// Tokens held by batch row `row`.
  int64_t seq_len(int64_t row) const { return seq_lens_.at(row); }
  const std::vector<int64_t>& seq_lens() const { return seq_lens_; }
  /// Records that `num_tokens` more tokens were written to `row`. Throws past max_seq_len.
  void advance(int64_t row, int64_t num_tokens);

  int64_t max_batch_size() const { return key_.size(0); }
  int64_t max_seq_len() const { return key_.size(1); }
  int64_t num_kv_heads() const { return key_.size(2); }
  int64_t head_dim() const { return key_.size(3); }
  /// Bytes of both buffers (of the one buffer of a latent cache), scales included.
  int64_t nbytes() const {
    int64_t bytes = 0;
    for (const at::Tensor* t : {&key_, &value_, &key_scale_, &value_scale_}) {
      const bool repeated = (t == &value_ && value_.is_same(key_)) ||
                            (t == &value_scale_ && value_scale_.is_same(key_scale_));
      if (t->defined() && !repeated) bytes += static_cast<int64_t>(t->nbytes());
    }
    return bytes;
  }

 private:
  at::Tensor key_;
  at::Tensor value_;
  at::Tensor key_scale_;    // int8 / fp8 buffers: fp32 [max_batch_size, max_seq_len, heads]
  at::Tensor value_scale_;
  std::vector<int64_t> seq_lens_;
};

/// The simple generation loop in one call: appends input_ids [B, S] (int64) to rows 0..B-1 of the
/// caches (one per layer, all at the same lengths), runs the model and returns fp32 logits
/// [B, S, vocab]. Throws if a row would exceed max_seq_len or B > max_batch_size.
at::Tensor forward_with_kv_cache(CausalLM& model, const at::Tensor& input_ids,
                                 const std::vector<KVCache*>& caches);

}  // namespace kvserve
