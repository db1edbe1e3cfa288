#pragma once
// The architecture of a decoder-only model, parsed from a Hugging Face config.json by the Python
// loader (python/kvserve/config.py) and consumed by the C++ model code.

#include <cstdint>
#include <string>
#include <vector>

namespace kvserve {

// Each config struct's fields are listed once, as X(type, name, default) entries: the struct's
// members and their Python attributes (csrc/bindings/bind_model.cpp) are both generated from
// the list, so a new field is one line here (and its reading in python/kvserve/config.py).
#define KVSERVE_DECLARE_FIELD(type, name, init) type name = init;

/// RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`).
#define KVSERVE_ROPE_SCALING_FIELDS(X)                                                      \
  X(std::string, rope_type, "default") /* default | linear | llama3 | yarn | longrope */    \
  X(double, factor, 1.0)                                                                    \
  X(double, low_freq_factor, 1.0)                 /* llama3 */                              \
  X(double, high_freq_factor, 4.0)                /* llama3 */                              \
  X(int64_t, original_max_position_embeddings, 0) /* llama3, yarn, longrope; 0: max */     \
  X(double, beta_fast, 32.0)                      /* yarn */                                \
  X(double, beta_slow, 1.0)                       /* yarn */                                \
  X(double, attention_factor, 0.0) /* yarn, longrope; 0 = derived from factor (mscale) */  \
  /* longrope: a divisor per rotated frequency, the long set for contexts past the original */ \
  X(std::vector<double>, short_factor, {})                                                  \
  X(std::vector<double>, long_factor, {})                                                   \
  X(double, mscale, 0.0)           /* yarn (DeepSeek); 0 = unset */                         \
  X(double, mscale_all_dim, 0.0)   /* yarn (DeepSeek); 0 = unset */                         \
  X(bool, truncate, true)          /* yarn: round the correction range to integers */

struct RopeScaling {
  KVSERVE_ROPE_SCALING_FIELDS(KVSERVE_DECLARE_FIELD)
};

/// Multi-head latent attention (DeepSeek-V2/V3). kv_lora_rank == 0: the model has none.
/// Each token caches one latent [kv_lora_rank] and one RoPE key [qk_rope_head_dim] shared by all
/// heads; kv_b_proj expands the latent to per-head keys [qk_nope_head_dim] and values
/// [v_head_dim]. attention_path: which form attends, "auto" (per sequence, by cost), "absorbed"
/// or "expanded" (tests and benchmarks; see layers/mla_attention.h).
#define KVSERVE_MLA_CONFIG_FIELDS(X)                                                        \
  X(int64_t, q_lora_rank, 0) /* 0: q_proj straight from the hidden state */                 \
  X(int64_t, kv_lora_rank, 0)                                                               \
  X(int64_t, qk_nope_head_dim, 0)                                                           \
  X(int64_t, qk_rope_head_dim, 0)                                                           \
  X(int64_t, v_head_dim, 0)                                                                 \
  X(bool, rope_interleave, true) /* RoPE rotates pairs (x0, x1), ... (V2; V3's flag) */      \
  X(std::string, attention_path, "auto")

struct MLAConfig {
  KVSERVE_MLA_CONFIG_FIELDS(KVSERVE_DECLARE_FIELD)
  /// qk_nope_head_dim + qk_rope_head_dim: the head size the softmax scale is computed from.
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

/// Mixture-of-experts MLP layers (DeepSeekMoE, Mixtral, Qwen3-MoE). num_experts == 0: none.
/// A token's router scores every routed expert; the top num_experts_per_tok run on it and their
/// outputs are summed with the routing weights, plus the shared experts' output (DeepSeek).
/// Group-limited routing (V2 group_limited_greedy, V3 noaux_tc): experts form n_group groups
/// and only the topk_group best groups compete; n_group 1: plain top-k.
#define KVSERVE_MOE_CONFIG_FIELDS(X)                                                        \
  X(int64_t, num_experts, 0)                                                                \
  X(int64_t, num_experts_per_tok, 0)                                                        \
  X(int64_t, moe_intermediate_size, 0)    /* per routed expert */                           \
  X(int64_t, shared_intermediate_size, 0) /* of the shared expert MLP; 0 = none */          \
  X(std::string, scoring_func, "softmax") /* softmax | sigmoid (V3, with a bias) */         \
  X(int64_t, n_group, 1)                                                                    \
  X(int64_t, topk_group, 1)                                                                 \
  X(bool, norm_topk_prob, false) /* renormalise the chosen weights to sum to 1 */           \
  X(double, routed_scaling_factor, 1.0)                                                     \
  X(bool, fp32_router, false) /* router logits from fp32 hidden states (DeepSeek) */        \
  X(bool, router_bias, false) /* the router has a bias (gpt-oss) */                         \
  X(bool, expert_bias, false) /* each expert's projections have biases (gpt-oss) */         \
  /* the experts' gate: silu (SwiGLU) | clamped_swiglu (gpt-oss, with alpha and limit) | */ \
  /* relu2 (Nemotron-H: no gate, relu(up)^2, the shared expert likewise) */                 \
  X(std::string, activation, "silu")                                                        \
  X(double, swiglu_alpha, 1.702)                                                            \
  X(double, swiglu_limit, 7.0)                                                              \
  /* routed experts in a latent space of this size (Nemotron-H's fc1 / fc2 latent */        \
  /* projections around them); 0: on the hidden state */                                    \
  X(int64_t, latent_size, 0)                                                                \
  X(std::vector<int64_t>, layers, {}) /* per layer: 1 = MoE MLP, 0 = dense MLP */

struct MoEConfig {
  KVSERVE_MOE_CONFIG_FIELDS(KVSERVE_DECLARE_FIELD)
};

/// State-space mixers in place of attention, in some layers (hybrids: Bamba, Granite 4, Jamba)
/// or all (Mamba2, Mamba), or beside attention in every layer (FalconH1: the two run on the same
/// normed input and their outputs are summed). layers empty: none. A Mamba2 mixer projects the
/// hidden state to
/// a gate z [heads * head_dim], the convolved channels (x [heads * head_dim], B and C [groups *
/// state_size] each) and dt [heads]; runs the depthwise causal convolution of conv_kernel taps
/// with SiLU, the selective scan (ops/ssm_scan.h, dt clamped to [dt_min, dt_max]), the gated
/// output (`norm`, over norm_groups groups) and the output projection. Each sequence keeps a conv
/// state [conv channels, conv_kernel - 1] and an SSM state [heads, head_dim, state_size] per
/// mixer layer: fixed in size, whatever its length (KVCacheLayout's state group). A Mamba
/// (kind "mamba", Gu & Dao 2023) mixer is the same with a head a channel (head_dim 1, num_heads
/// its inner size, one group): x and the gate from the input, B, C and a low-rank dt from the
/// convolved x (x_proj, then dt_proj up to a dt a channel), a decay per channel and state entry,
/// the gate alone after the scan; its conv channels are x's alone.
#define KVSERVE_SSM_CONFIG_FIELDS(X)                                                        \
  /* per layer: 0 = attention, 1 = SSM mixer, 2 = both in parallel (FalconH1), */           \
  /* 3 = neither: the layer is its MLP alone (Nemotron-H) */                               \
  X(std::vector<int64_t>, layers, {})                                                       \
  X(int64_t, num_heads, 0)                                                                  \
  X(int64_t, head_dim, 0)                                                                   \
  X(int64_t, state_size, 0)                                                                 \
  X(int64_t, n_groups, 1)      /* groups of heads sharing B and C */                        \
  X(int64_t, conv_kernel, 4)                                                                \
  X(int64_t, norm_groups, 1)   /* groups of the gated RMSNorm over heads * head_dim */      \
  /* a tensor-parallel rank's: its one norm group is part of a group over every rank's */   \
  /* heads (its sums of squares are summed over the ranks) */                              \
  X(bool, norm_spans_ranks, false)                                                          \
  /* the scan's output y and the gate z: gate_then_norm, RMSNorm(y * silu(z)) (Mamba2); */  \
  /* norm_then_gate, RMSNorm(y) * silu(z); gate_only, y * silu(z) (FalconH1's options) */   \
  X(std::string, norm, "gate_then_norm")                                                    \
  X(bool, conv_bias, true)                                                                  \
  X(bool, proj_bias, false)     /* bias on in_proj */                                       \
  X(bool, out_proj_bias, false) /* bias on out_proj */                                      \
  X(double, dt_min, 0.0)                                                                    \
  X(double, dt_max, 1e30)      /* time_step_limit; 1e30: none */                            \
  X(bool, mlp, true)           /* every layer has an MLP after its mixer (Mamba2: none) */ \
  /* (layers of kind 3 are an MLP whatever this says) */                                    \
  X(std::string, kind, "mamba2") /* or "mamba" (S6) */                                      \
  X(int64_t, time_step_rank, 0)  /* mamba: dt's rank before dt_proj */                      \
  /* mamba: dt, B and C each RMS-normed before use: "weighted" (Jamba: dt_norm, B_norm and */ \
  /* C_norm weights), "plain" (FalconMamba: no weights), "none" */                          \
  X(std::string, dt_bc_norm, "none")                                                        \
  X(double, dt_bc_norm_eps, 1e-6)

struct SSMConfig {
  KVSERVE_SSM_CONFIG_FIELDS(KVSERVE_DECLARE_FIELD)
  int64_t inner_size() const { return num_heads * head_dim; }
  /// Channels of the causal convolution: x, B and C (Mamba2); x alone (Mamba).
  int64_t conv_dim() const {
    return kind == "mamba" ? inner_size() : inner_size() + 2 * n_groups * state_size;
  }
};

/// How the checkpoint's quantized projections hold their weights, as the loader names it from
/// the checkpoint's quantization_config (python/kvserve/quantization/formats.py). A projection
/// with a plain `.weight` is plain whatever the scheme (modules a checkpoint leaves unquantized).
#define KVSERVE_QUANTIZATION_CONFIG_FIELDS(X)                                               \
  X(std::string, scheme, "none") /* none | int8 | int4 | fp8 | llm.int8 | mixed (by dtype) */ \
  /* llm.int8: activation columns with an |x| at or over this run in float, the rest in */  \
  /* int8 per token; 0: none (W8A8). Routed experts run their int8 weights weight-only. */  \
  X(double, outlier_threshold, 6.0)                                                         \
  /* exact | int8: int8 / int4 projections round their input to int8 blocks and multiply */ \
  /* in integers (quantized_linear's quantize_input) */                                     \
  X(std::string, activation, "exact")

struct QuantizationConfig {
  KVSERVE_QUANTIZATION_CONFIG_FIELDS(KVSERVE_DECLARE_FIELD)
};

/// Everything the runtime needs to know about a checkpoint. head_dim is qk_rope_head_dim (the
/// RoPE size) when mla is in use. kv_sources: cross-layer KV sharing (CLA, kvserve's
/// `kv_sharing` config extension), per layer the earlier layer whose cached K/V it attends over
/// instead of writing its own (its own index when it owns its KV); empty: every layer owns its
/// KV.
#define KVSERVE_MODEL_CONFIG_FIELDS(X)                                                      \
  X(std::string, architecture, "") /* e.g. "LlamaForCausalLM" */                            \
  X(std::string, family, "llama")  /* its C++ model class (models/model_factory.h) */       \
  X(int64_t, vocab_size, 0)                                                                 \
  X(int64_t, hidden_size, 0)                                                                \
  X(int64_t, intermediate_size, 0)                                                          \
  X(int64_t, num_layers, 0)                                                                 \
  X(int64_t, num_heads, 0)                                                                  \
  X(int64_t, num_kv_heads, 0)                                                               \
  X(int64_t, head_dim, 0)                                                                   \
  X(int64_t, max_position_embeddings, 0)                                                    \
  X(double, rms_norm_eps, 1e-6) /* the norms' epsilon (a LayerNorm's too) */                \
  X(double, rope_theta, 10000.0)                                                            \
  X(RopeScaling, rope_scaling, {})                                                          \
  X(int64_t, rotary_dim, 0) /* dims RoPE rotates (partial rotary); 0 = head_dim */          \
  X(bool, rope_interleave, false) /* RoPE rotates pairs (x0, x1), ... (Cohere); else halves */ \
  X(bool, tie_word_embeddings, false)                                                       \
  X(bool, qkv_bias, false)    /* bias on q/k/v (Qwen2, Llama attention_bias) */             \
  X(bool, o_proj_bias, false) /* bias on the output projection (Llama attention_bias) */    \
  X(bool, mlp_bias, false)    /* bias on gate/up/down (Llama mlp_bias) */                   \
  X(bool, qk_norm, false)     /* per-head RMSNorm of q and k before RoPE (Qwen3) */         \
  X(bool, qk_norm_full_width, false) /* qk_norm over all heads at once (OLMo 2) */           \
  X(std::vector<int64_t>, sliding_windows, {}) /* per layer, in tokens; 0 = full */         \
  X(double, rope_local_theta, 0.0) /* RoPE base of sliding layers (Gemma 3); 0 = global's */ \
  X(std::string, hidden_act, "silu") /* silu (SwiGLU) | gelu_pytorch_tanh (GeGLU) | relu2 */ \
  X(bool, gated_mlp, true) /* down(act(gate) * up); false: down(act(up)) (Nemotron-H) */   \
  X(double, norm_weight_offset, 0.0) /* RMSNorms scale by offset + weight (Gemma: 1 + w) */ \
  X(double, embedding_multiplier, 1.0) /* embeddings times this, in the weight dtype */     \
  X(bool, sandwich_norms, false) /* norms on the attention and MLP outputs (Gemma 2/3) */    \
  X(bool, post_norms, false) /* norms on those outputs only, none before them (OLMo 2) */     \
  X(std::string, norm_type, "rms_norm") /* rms_norm | layer_norm (Cohere: LayerNorms) */    \
  /* attention and MLP both read the layer's one norm; their outputs join the residual */   \
  X(bool, parallel_block, false) /* (Cohere) */                                             \
  X(double, query_pre_attn_scalar, 0.0) /* scale is this^-0.5; 0 = head_dim^-0.5 */         \
  X(double, attn_logit_softcap, 0.0)    /* scores -> c * tanh(s / c); 0 = none */           \
  X(bool, attention_sinks, false) /* a learned logit per head in each softmax (gpt-oss) */   \
  X(double, final_logit_softcap, 0.0)   /* LM-head logits likewise; 0 = none */             \
  X(double, residual_multiplier, 1.0) /* each layer's outputs times this into the residual */ \
  X(double, logits_scaling, 1.0)      /* LM-head logits divided by this (Granite) */          \
  X(bool, no_rope, false) /* attention without positional encoding (NoPE, Granite 4) */      \
  X(std::vector<int64_t>, nope_layers, {}) /* per layer: 1 = no RoPE (SmolLM3); empty: none */ \
  X(std::vector<int64_t>, kv_sources, {})                                                   \
  X(MLAConfig, mla, {})                                                                     \
  X(MoEConfig, moe, {})                                                                     \
  X(SSMConfig, ssm, {})                                                                     \
  X(QuantizationConfig, quantization, {})

struct ModelConfig {
  KVSERVE_MODEL_CONFIG_FIELDS(KVSERVE_DECLARE_FIELD)

  bool use_mla() const { return mla.kv_lora_rank > 0; }
  /// The layer whose K/V `layer` attends over (itself unless it shares an earlier layer's).
  int64_t kv_source(int64_t layer) const {
    return kv_sources.empty() ? layer : kv_sources.at(layer);
  }
  /// Whether `layer`'s attention rotates its queries and keys (not NoPE).
  bool uses_rope(int64_t layer) const {
    return !no_rope && (nope_layers.empty() || nope_layers.at(layer) == 0);
  }
  /// Whether `layer` has a state-space mixer (alone, or beside attention).
  bool has_mixer(int64_t layer) const {
    return !ssm.layers.empty() && (ssm.layers.at(layer) == 1 || ssm.layers.at(layer) == 2);
  }
  /// Whether `layer` attends (alone, or beside a mixer).
  bool has_attention(int64_t layer) const {
    return ssm.layers.empty() || ssm.layers.at(layer) == 0 || ssm.layers.at(layer) == 2;
  }
  /// Whether `layer` is an MLP alone: no mixer, no attention (Nemotron-H's "-" layers).
  bool mlp_only(int64_t layer) const { return !ssm.layers.empty() && ssm.layers.at(layer) == 3; }
  /// Whether `layer` has an MLP (or mixture of experts) after its mixer or attention, or alone.
  bool has_mlp(int64_t layer) const { return ssm.mlp || mlp_only(layer); }
  /// Layers with a state-space mixer.
  int64_t num_ssm_layers() const;
  /// Layers that write K/V, each with a cache of its own: every attention layer but the sharing
  /// ones.
  int64_t num_kv_layers() const;
  /// Index of the cache that `layer`'s attention reads among the forward's caches: the
  /// num_kv_layers() KV caches come first (a layer that shares KV reads its source's).
  int64_t kv_cache_index(int64_t layer) const;
  /// Index of `layer`'s mixer state among the forward's caches: after the KV caches, one per
  /// mixer layer in order (num_kv_layers() + its rank among the mixer layers).
  int64_t state_cache_index(int64_t layer) const;
  bool is_moe_layer(int64_t layer) const {
    return moe.num_experts > 0 && !moe.layers.empty() && moe.layers.at(layer) != 0;
  }

  /// Throws std::invalid_argument naming the first inconsistent field.
  void validate() const;
};

}  // namespace kvserve
