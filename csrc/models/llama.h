#pragma once
// The Llama family: Llama 2/3 (incl. Llama-3 RoPE scaling, tied or untied embeddings), Mistral,
// Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm, explicit head_dim) and their mixture-of-experts
// siblings Mixtral and Qwen3-MoE (a SparseMoE in place of the dense MLP of some or all layers),
// and Gemma 2/3 (sandwich norms, (1 + w) norms, GeGLU, scaled embeddings, soft-caps, local
// sliding-window layers with their own RoPE base). The differences are flags of ModelConfig; the
// layer structure is shared (DecoderLM).

#include <ATen/core/Tensor.h>

#include <vector>

#include "layers/attention.h"
#include "layers/rotary.h"
#include "models/decoder_lm.h"

namespace kvserve {

/// A DecoderLM whose layers attend with Attention (fused qkv, RoPE, paged K/V).
class LlamaForCausalLM : public DecoderLM<Attention> {
 public:
  /// Throws std::invalid_argument on a missing weight or inconsistent config.
  /// max_positions bounds the positions this instance will see (the RoPE table size).
  LlamaForCausalLM(const ModelConfig& config, const WeightMap& weights, int64_t max_positions);

  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                     const AttentionMetadata& metadata,
                     const std::vector<LayerKVCache>& kv_caches) override;
  at::Tensor forward_embeds(const at::Tensor& inputs, const at::Tensor& positions,
                            const AttentionMetadata& metadata,
                            const std::vector<LayerKVCache>& kv_caches) override;

 private:
  RotaryEmbedding rotary_;
  RotaryEmbedding rotary_local_;  // sliding-window layers' own RoPE (config.rope_local_theta)
};

}  // namespace kvserve
