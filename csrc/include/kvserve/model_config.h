#pragma once
// The architecture of a decoder-only model, parsed from a Hugging Face config.json by the Python
// loader (python/kvserve/config.py) and consumed by the C++ model code.

#include <cstdint>
#include <string>
#include <vector>

namespace kvserve {

/// RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`).
struct RopeScaling {
  std::string rope_type = "default";  ///< default | linear | llama3 | yarn
  double factor = 1.0;
  double low_freq_factor = 1.0;                  ///< llama3
  double high_freq_factor = 4.0;                 ///< llama3
  int64_t original_max_position_embeddings = 0;  ///< llama3, yarn; 0 = max_position_embeddings
  double beta_fast = 32.0;                       ///< yarn
  double beta_slow = 1.0;                        ///< yarn
  double attention_factor = 0.0;                 ///< yarn; 0 = derived from factor
};

/// Everything the Llama-family runtime needs to know about a checkpoint.
struct ModelConfig {
  std::string architecture;  ///< e.g. "LlamaForCausalLM"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;       ///< bias on q/k/v projections (Qwen2, Llama attention_bias)
  bool o_proj_bias = false;    ///< bias on the output projection (Llama attention_bias)
  bool mlp_bias = false;       ///< bias on gate/up/down (Llama mlp_bias)
  bool qk_norm = false;        ///< per-head RMSNorm of q and k before RoPE (Qwen3)
  std::vector<int64_t> sliding_windows;  ///< per layer, in tokens; 0 = full attention

  /// Throws std::invalid_argument naming the first inconsistent field.
  void validate() const;
};

}  // namespace kvserve
