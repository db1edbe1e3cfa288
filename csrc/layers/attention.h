#pragma once
// Self-attention block of the Llama family: fused qkv projection, optional per-head q/k norm,
// RoPE, cache write, paged attention (sliding window, soft-capped scores), output projection.

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/model_config.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/rotary.h"
#include "layers/weights.h"

namespace kvserve {

/// One layer's attention. Weights: `<prefix>qkv_proj.weight` [(H + 2 Hkv) * D, hidden] (+ bias),
/// `<prefix>o_proj.weight` [hidden, H * D] (+ bias), optional `<prefix>q_norm.weight` /
/// `<prefix>k_norm.weight` [D] ([H * D] / [Hkv * D] with config.qk_norm_full_width: over all
/// heads at once, the rank's heads' part when split), and with config.attention_sinks `<prefix>sinks` [H] (a logit
/// per head in its softmax, kept in fp32). A layer that shares an earlier layer's KV (config.kv_sources)
/// has `<prefix>q_proj.weight` [H * D, hidden] (+ bias) instead of qkv_proj and no k_norm: it
/// attends over the cache it is given and writes nothing. A null rotary: no positional encoding
/// (NoPE).
class Attention {
 public:
  Attention(const ModelConfig& config, int64_t layer, const WeightMap& weights,
            const RotaryEmbedding* rotary);

  /// hidden [T, hidden_size] -> [T, hidden_size]; writes this step's K/V into kv_cache first.
  at::Tensor forward(const at::Tensor& positions, const at::Tensor& hidden,
                     const AttentionMetadata& metadata, const LayerKVCache& kv_cache) const;

  int64_t weight_bytes() const;

  /// Its projections that can serve LoRA adapters, by name under its prefix.
  std::vector<LoraLinear> lora_linears() {
    if (shares_kv_) return {{"q_proj", &qkv_proj_, 1}, {"o_proj", &o_proj_, 1}};
    return {{"qkv_proj", &qkv_proj_, 3}, {"o_proj", &o_proj_, 1}};
  }

 private:
  /// x [T, width] normed over all heads: by `norm` alone, or split over ranks with their sums
  /// of squares summed (every rank holds the same width of heads, replicated ones included).
  at::Tensor full_width_norm(const RMSNorm& norm, const at::Tensor& x) const;

  Linear qkv_proj_;
  Linear o_proj_;
  RMSNorm q_norm_;
  RMSNorm k_norm_;
  at::Tensor sinks_;  // fp32 [H], or undefined: none
  const RotaryEmbedding* rotary_;
  int64_t num_heads_, num_kv_heads_, head_dim_, sliding_window_;
  double scale_;
  double logit_softcap_;
  bool shares_kv_;  // CLA: reads an earlier layer's K/V, writes none
  bool full_width_qk_norm_ = false;  // q_norm_ / k_norm_ over all heads (OLMo 2), not per head
  // Split over tensor-parallel ranks, the full-width norms' sums of squares summed over them.
  std::shared_ptr<Communicator> norm_ranks_;
};

}  // namespace kvserve
