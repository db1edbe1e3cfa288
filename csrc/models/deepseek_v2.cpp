#include "models/deepseek_v2.h"

#include <cmath>
#include <stdexcept>

namespace kvserve {

double mla_softmax_scale(const ModelConfig& c) {
  double scale = 1.0 / std::sqrt(static_cast<double>(c.mla.qk_head_dim()));
  const RopeScaling& s = c.rope_scaling;
  if (s.rope_type != "default" && s.mscale_all_dim > 0 && s.factor > 1.0) {
    const double mscale = 0.1 * s.mscale_all_dim * std::log(s.factor) + 1.0;
    scale *= mscale * mscale;
  }
  return scale;
}

DeepseekV2ForCausalLM::DeepseekV2ForCausalLM(const ModelConfig& config, const WeightMap& w,
                                             int64_t max_positions)
    : DecoderLM(config, w) {
  if (!config_.use_mla()) {
    throw std::invalid_argument(config_.architecture + " needs kv_lora_rank > 0 (MLA)");
  }
  // RoPE covers the qk_rope_head_dim part of each head (config.head_dim), in DeepSeek's pairs.
  rotary_ = RotaryEmbedding(config_, max_positions, device_, !config_.mla.rope_interleave);
  const double scale = mla_softmax_scale(config_);
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    add_layer(i, std::make_unique<MLAAttention>(config_, i, w, &rotary_, scale), w);
  }
  finish(w);
}

at::Tensor DeepseekV2ForCausalLM::forward(const at::Tensor& input_ids, const at::Tensor& positions,
                                          const AttentionMetadata& metadata,
                                          const std::vector<LayerKVCache>& kv_caches) {
  return forward_embeds(embed_inputs(input_ids), positions, metadata, kv_caches);
}

at::Tensor DeepseekV2ForCausalLM::forward_embeds(const at::Tensor& inputs,
                                                 const at::Tensor& positions,
                                                 const AttentionMetadata& metadata,
                                                 const std::vector<LayerKVCache>& kv_caches) {
  // Which sequences attend in absorbed and which in expanded form: the same for every layer.
  const MLABatchPlan plan =
      kv_caches.empty() ? MLABatchPlan()
                        : MLABatchPlan::make(metadata, config_.mla, kv_caches[0].key.size(1),
                                             config_.mla.attention_path);
  return run_layers(inputs, positions, kv_caches, metadata,
                    [&](size_t, const MLAAttention& attention, const at::Tensor& hidden,
                        const LayerKVCache& cache) {
                      return attention.forward(positions, hidden, metadata, cache, plan);
                    });
}

}  // namespace kvserve
