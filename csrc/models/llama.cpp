#include "models/llama.h"

namespace kvserve {

LlamaForCausalLM::LlamaForCausalLM(const ModelConfig& config, const WeightMap& w,
                                   int64_t max_positions)
    : DecoderLM(config, w) {
  // No table without attention layers (Mamba2): a long context would cost its rows for nothing.
  if (config_.num_kv_layers() > 0 && !config_.no_rope) {
    rotary_ = RotaryEmbedding(config_, max_positions, device_, !config_.rope_interleave);
  }
  if (config_.rope_local_theta > 0) {  // Gemma 3: local layers rotate with an unscaled base
    ModelConfig local = config_;
    local.rope_theta = config_.rope_local_theta;
    local.rope_scaling = RopeScaling();
    rotary_local_ = RotaryEmbedding(local, max_positions, device_, !config_.rope_interleave);
  }
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const bool local = config_.rope_local_theta > 0 && !config_.sliding_windows.empty() &&
                       config_.sliding_windows[i] > 0;
    if (!config_.has_attention(i)) {
      add_layer(i, nullptr, w);
    } else {
      const RotaryEmbedding* rotary = !config_.uses_rope(i) ? nullptr
                                      : local                 ? &rotary_local_
                                                              : &rotary_;
      add_layer(i, std::make_unique<Attention>(config_, i, w, rotary), w);
    }
  }
  finish(w);
}

at::Tensor LlamaForCausalLM::forward(const at::Tensor& input_ids, const at::Tensor& positions,
                                     const AttentionMetadata& metadata,
                                     const std::vector<LayerKVCache>& kv_caches) {
  return forward_embeds(embed_inputs(input_ids), positions, metadata, kv_caches);
}

at::Tensor LlamaForCausalLM::forward_embeds(const at::Tensor& inputs, const at::Tensor& positions,
                                            const AttentionMetadata& metadata,
                                            const std::vector<LayerKVCache>& kv_caches) {
  return run_layers(inputs, positions, kv_caches, metadata,
                    [&](size_t, const Attention& attention, const at::Tensor& hidden,
                        const LayerKVCache& cache) {
                      return attention.forward(positions, hidden, metadata, cache);
                    });
}

}  // namespace kvserve
