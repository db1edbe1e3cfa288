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
  double attention_factor = 0.0;                 ///< yarn; 0 = derived from factor and mscale
  double mscale = 0.0;                           ///< yarn (DeepSeek); 0 = unset
  double mscale_all_dim = 0.0;                   ///< yarn (DeepSeek); 0 = unset
  bool truncate = true;                          ///< yarn: round the correction range to integers
};

/// Multi-head latent attention (DeepSeek-V2/V3). kv_lora_rank == 0: the model has none.
/// Each token caches one latent [kv_lora_rank] and one RoPE key [qk_rope_head_dim] shared by all
/// heads; kv_b_proj expands the latent to per-head keys [qk_nope_head_dim] and values
/// [v_head_dim].
struct MLAConfig {
  int64_t q_lora_rank = 0;  ///< 0: q_proj straight from the hidden state
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = true;  ///< RoPE rotates pairs (x0, x1), (x2, x3), ... (V2; V3's flag)
  /// Which form attends: "auto" (per sequence, by cost), "absorbed" or "expanded" (tests and
  /// benchmarks; see layers/mla_attention.h).
  std::string attention_path = "auto";
  /// qk_nope_head_dim + qk_rope_head_dim: the head size the softmax scale is computed from.
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

/// Mixture-of-experts MLP layers (DeepSeekMoE, Mixtral, Qwen3-MoE). num_experts == 0: none.
/// A token's router scores every routed expert; the top num_experts_per_tok run on it and their
/// outputs are summed with the routing weights, plus the shared experts' output (DeepSeek).
struct MoEConfig {
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;  ///< per routed expert
  int64_t shared_intermediate_size = 0;  ///< of the always-on shared expert MLP; 0 = none
  std::string scoring_func = "softmax";  ///< softmax | sigmoid (V3, with a correction bias)
  /// Group-limited routing (V2 group_limited_greedy, V3 noaux_tc): experts form n_group groups
  /// and only the topk_group best groups compete. n_group 1: plain top-k.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = false;  ///< renormalise the chosen weights to sum to 1
  double routed_scaling_factor = 1.0;
  bool fp32_router = false;  ///< router logits from fp32 hidden states (DeepSeek)
  std::vector<int64_t> layers;  ///< per layer: 1 = MoE MLP, 0 = dense MLP
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
  double rope_local_theta = 0.0;  ///< RoPE base of sliding-window layers, unscaled (Gemma 3);
                                  ///< 0 = they rotate as the full-attention layers
  std::string hidden_act = "silu";      ///< MLP gate: silu (SwiGLU) | gelu_pytorch_tanh (GeGLU)
  double norm_weight_offset = 0.0;      ///< RMSNorms scale by offset + weight (Gemma: 1 + w, fp32)
  double embedding_multiplier = 1.0;    ///< embeddings times this, rounded to the weight dtype
  bool sandwich_norms = false;          ///< norms on the attention and MLP outputs too (Gemma 2/3)
  double query_pre_attn_scalar = 0.0;   ///< attention scale is this^-0.5; 0 = head_dim^-0.5
  double attn_logit_softcap = 0.0;      ///< attention scores -> c * tanh(s / c); 0 = none
  double final_logit_softcap = 0.0;     ///< LM-head logits likewise; 0 = none
  /// Cross-layer KV sharing (CLA, kvserve's `kv_sharing` config extension): per layer, the
  /// earlier layer whose cached K/V it attends over instead of writing its own (its own index
  /// when it owns its KV). Empty: every layer owns its KV.
  std::vector<int64_t> kv_sources;
  MLAConfig mla;  ///< head_dim is qk_rope_head_dim (the RoPE size) when mla is in use
  MoEConfig moe;

  bool use_mla() const { return mla.kv_lora_rank > 0; }
  /// The layer whose K/V `layer` attends over (itself unless it shares an earlier layer's).
  int64_t kv_source(int64_t layer) const {
    return kv_sources.empty() ? layer : kv_sources.at(layer);
  }
  /// Layers that write K/V, each with a cache of its own: every layer but the sharing ones.
  int64_t num_kv_layers() const;
  /// Index of the cache that `layer` reads among the num_kv_layers() caches.
  int64_t kv_cache_index(int64_t layer) const;
  bool is_moe_layer(int64_t layer) const {
    return moe.num_experts > 0 && !moe.layers.empty() && moe.layers.at(layer) != 0;
  }

  /// Throws std::invalid_argument naming the first inconsistent field.
  void validate() const;
};

}  // namespace kvserve
