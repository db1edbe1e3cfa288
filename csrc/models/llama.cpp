#include "models/llama.h"

#include <ATen/ops/embedding.h>

#include "layers/mlp.h"
#include "layers/moe.h"

namespace kvserve {

LlamaForCausalLM::LlamaForCausalLM(const ModelConfig& config, const WeightMap& w,
                                   int64_t max_positions)
    : config_(config),
      embed_tokens_(w.get("embed_tokens.weight")),
      dtype_(embed_tokens_.scalar_type()),
      device_(embed_tokens_.device()) {
  config_.validate();
  TORCH_CHECK(embed_tokens_.dim() == 2 && embed_tokens_.size(0) == config_.vocab_size &&
                  embed_tokens_.size(1) == config_.hidden_size,
              "embed_tokens.weight must be [", config_.vocab_size, ", ", config_.hidden_size,
              "], got ", embed_tokens_.sizes());
  rotary_ = RotaryEmbedding(config_, max_positions, embed_tokens_.device());
  layers_.reserve(config_.num_layers);
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer layer;
    layer.input_layernorm = RMSNorm(w.get(p + "input_layernorm.weight"), config_.rms_norm_eps);
    layer.self_attn = std::make_unique<Attention>(config_, i, w, &rotary_);
    layer.post_attention_layernorm =
        RMSNorm(w.get(p + "post_attention_layernorm.weight"), config_.rms_norm_eps);
    if (config_.is_moe_layer(i)) {
      layer.mlp = std::make_unique<SparseMoE>(config_.moe, p + "mlp.", w);
    } else {
      layer.mlp = std::make_unique<GatedMLP>(p + "mlp.", w);
    }
    layers_.push_back(std::move(layer));
  }
  norm_ = RMSNorm(w.get("norm.weight"), config_.rms_norm_eps);
  lm_head_ = Linear(config_.tie_word_embeddings ? embed_tokens_ : w.get("lm_head.weight"),
                    at::Tensor());
  // A tied embedding reads its rows from the LM head's (packed) weight: one copy of the matrix.
  if (config_.tie_word_embeddings && lm_head_.packed()) embed_tokens_ = at::Tensor();
}

at::Tensor LlamaForCausalLM::forward(const at::Tensor& input_ids, const at::Tensor& positions,
                                     const AttentionMetadata& metadata,
                                     const std::vector<LayerKVCache>& kv_caches) {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "forward: got ", kv_caches.size(),
              " KV caches for ", layers_.size(), " layers");
  TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes(),
              "forward: input_ids and positions must both be [T]");
  at::Tensor hidden = embed_tokens_.defined() ? at::embedding(embed_tokens_, input_ids)
                                              : lm_head_.rows(input_ids);  // [T, hidden]
  at::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    if (i == 0) {
      residual = hidden;
      hidden = layer.input_layernorm.forward(residual);
    } else {
      layer.input_layernorm.forward_fused(hidden, residual);
    }
    hidden = layer.self_attn->forward(positions, hidden, metadata, kv_caches[i]);
    layer.post_attention_layernorm.forward_fused(hidden, residual);
    hidden = layer.mlp->forward(hidden);
  }
  if (layers_.empty()) return norm_.forward(hidden);
  norm_.forward_fused(hidden, residual);
  return hidden;
}

at::Tensor LlamaForCausalLM::compute_logits(const at::Tensor& hidden) {
  return lm_head_.forward(hidden).to(at::kFloat);
}

int64_t LlamaForCausalLM::weight_bytes() const {
  // A tied LM head shares the embedding matrix (or holds it alone, packed).
  int64_t bytes = norm_.weight_bytes() + lm_head_.weight_bytes();
  if (!config_.tie_word_embeddings) bytes += embed_tokens_.nbytes();
  for (const Layer& layer : layers_) {
    bytes += layer.input_layernorm.weight_bytes() + layer.self_attn->weight_bytes() +
             layer.post_attention_layernorm.weight_bytes() + layer.mlp->weight_bytes();
  }
  return bytes;
}

}  // namespace kvserve
