#pragma once
// DeepSeek-V2 and -V3: multi-head latent attention on a latent paged KV cache, and DeepSeekMoE
// (routed plus shared experts) in every layer from first_k_dense_replace on. V3 differs in its
// router (sigmoid scores with a correction bias, group top-2 ranking) and its RoPE layout flag;
// both are ModelConfig fields, so one class runs both.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "kvserve/causal_lm.h"
#include "layers/feed_forward.h"
#include "layers/linear.h"
#include "layers/mla_attention.h"
#include "layers/norm.h"
#include "layers/rotary.h"
#include "layers/weights.h"

namespace kvserve {

/// Pre-norm decoder: embed -> L x (norm, MLA, residual, norm, MLP or MoE, residual) -> norm.
/// Weights (loader names): embed_tokens.weight, norm.weight, lm_head.weight unless tied, and per
/// layer input_layernorm.weight, post_attention_layernorm.weight plus those of MLAAttention and
/// of GatedMLP (dense layers) or SparseMoE.
class DeepseekV2ForCausalLM : public CausalLM {
 public:
  /// Throws std::invalid_argument on a missing weight or a config without MLA.
  DeepseekV2ForCausalLM(const ModelConfig& config, const WeightMap& weights,
                        int64_t max_positions);

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
    std::unique_ptr<MLAAttention> self_attn;
    RMSNorm post_attention_layernorm;
    std::unique_ptr<FeedForward> mlp;
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

/// The softmax scale of MLA: qk_head_dim^-0.5, times mscale^2 under yarn scaling with
/// mscale_all_dim (mscale = 0.1 mscale_all_dim ln(factor) + 1).
double mla_softmax_scale(const ModelConfig& config);

}  // namespace kvserve
