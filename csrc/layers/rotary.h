#pragma once
// Rotary position embedding with the cos/sin table precomputed for every position.

#include <ATen/core/Tensor.h>

#include "kvserve/model_config.h"
#include "layers/norm.h"

namespace kvserve {

/// Precomputes cos/sin for positions [0, max_positions) from the config's rope_theta and
/// rope_scaling (default, linear, llama3, yarn, longrope: its set chosen by max_positions), in
/// fp32 as Hugging Face does.
class RotaryEmbedding {
 public:
  RotaryEmbedding() = default;
  /// Throws std::invalid_argument for an unsupported rope_type.
  RotaryEmbedding(const ModelConfig& config, int64_t max_positions, at::Device device,
                  bool is_neox = true);

  /// Rotates query [T, num_heads * head_dim] and key [T, num_kv_heads * head_dim] in place;
  /// with query_norm / key_norm, each head of that side is RMS-normalized first (Qwen3's and
  /// Gemma 3's q_norm / k_norm), in the same pass.
  void apply(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
             const RMSNorm* query_norm = nullptr, const RMSNorm* key_norm = nullptr) const;

  /// fp32 [max_positions, rot_dim]: rot_dim/2 cosines then rot_dim/2 sines; rot_dim is the
  /// config's rotary_dim (partial rotary: the head's other dims pass through), else head_dim.
  const at::Tensor& cos_sin_cache() const { return cos_sin_cache_; }

 private:
  at::Tensor cos_sin_cache_;
  int64_t head_dim_ = 0;
  bool is_neox_ = true;
};

/// Inverse frequencies fp32 [rot_dim / 2] and the attention scaling factor for a config, for a
/// model that runs contexts of up to `context` positions (0: max_position_embeddings). Only
/// LongRoPE reads it: its long factors serve contexts past the original one, its short factors
/// the others (one set per model, whatever a forward's positions: as llama.cpp chooses by
/// context size; transformers switches per forward, by its longest position).
std::pair<at::Tensor, double> rope_inverse_frequencies(const ModelConfig& config,
                                                       int64_t context = 0);

}  // namespace kvserve
