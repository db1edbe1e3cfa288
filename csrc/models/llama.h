#pragma once
// The Llama family: Llama 2/3 (incl. Llama-3 RoPE scaling, tied or untied embeddings), Mistral,
// Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm, explicit head_dim) and their mixture-of-experts
// siblings Mixtral and Qwen3-MoE (a SparseMoE in place of the dense MLP of some or all layers).
// The differences are flags of ModelConfig; the layer structure is shared.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "kvserve/causal_lm.h"
#include "layers/attention.h"
#include "layers/feed_forward.h"
#include "layers/norm.h"
#include "layers/rotary.h"
#include "layers/weights.h"

namespace kvserve {

/// Pre-norm decoder: embed -> L x (norm, attention, residual, norm, MLP, residual) -> norm.
/// Weights (loader names, already fused): embed_tokens.weight [vocab, hidden], norm.weight,
/// lm_head.weight unless tied, and per layer input_layernorm.weight,
/// post_attention_layernorm.weight plus those of Attention and of GatedMLP or SparseMoE.
class LlamaForCausalLM : public CausalLM {
 public:
  /// Throws std::invalid_argument on a missing weight or inconsistent config.
  /// max_positions bounds the positions this instance will see (the RoPE table size).
  LlamaForCausalLM(const ModelConfig& config, const WeightMap& weights, int64_t max_positions);

  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                     const AttentionMetadata& metadata,
                     const std::vector<LayerKVCache>& kv_caches) override;
  at::Tensor compute_logits(const at::Tensor& hidden) override;
  const ModelConfig& config() const override { return config_; }
  at::ScalarType dtype() const override { return dtype_; }
  at::Device device() const override { return device_; }
  int64_t weight_bytes() const override;

 private:
  struct Layer {
    RMSNorm input_layernorm;
    std::unique_ptr<Attention> self_attn;
    RMSNorm post_attention_layernorm;
    std::unique_ptr<FeedForward> mlp;  // GatedMLP, or SparseMoE on the config's MoE layers
  };

  ModelConfig config_;
  at::Tensor embed_tokens_;  // [vocab, hidden]; undefined when tied to a packed lm_head_
  at::ScalarType dtype_;
  at::Device device_;
  RotaryEmbedding rotary_;
  std::vector<Layer> layers_;
  RMSNorm norm_;
  Linear lm_head_;
};

}  // namespace kvserve
