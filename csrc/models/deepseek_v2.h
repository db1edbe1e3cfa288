#pragma once
// DeepSeek-V2 and -V3: multi-head latent attention on a latent paged KV cache, and DeepSeekMoE
// (routed plus shared experts) in every layer from first_k_dense_replace on. V3 differs in its
// router (sigmoid scores with a correction bias, group top-2 ranking) and its RoPE layout flag;
// both are ModelConfig fields, so one class runs both.

#include <ATen/core/Tensor.h>

#include <vector>

#include "layers/mla_attention.h"
#include "layers/rotary.h"
#include "models/decoder_lm.h"

namespace kvserve {

/// A DecoderLM whose layers attend with MLAAttention; the MLA batch plan (which sequences attend
/// absorbed, which expanded) is made once per forward and shared by every layer.
class DeepseekV2ForCausalLM : public DecoderLM<MLAAttention> {
 public:
  /// Throws std::invalid_argument on a missing weight or a config without MLA.
  DeepseekV2ForCausalLM(const ModelConfig& config, const WeightMap& weights,
                        int64_t max_positions);

  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                     const AttentionMetadata& metadata,
                     const std::vector<LayerKVCache>& kv_caches) override;
  at::Tensor forward_embeds(const at::Tensor& inputs, const at::Tensor& positions,
                            const AttentionMetadata& metadata,
                            const std::vector<LayerKVCache>& kv_caches) override;

 private:
  RotaryEmbedding rotary_;
};

/// The softmax scale of MLA: qk_head_dim^-0.5, times mscale^2 under yarn scaling with
/// mscale_all_dim (mscale = 0.1 mscale_all_dim ln(factor) + 1).
double mla_softmax_scale(const ModelConfig& config);

}  // namespace kvserve
