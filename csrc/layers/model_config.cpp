#include "kvserve/model_config.h"

#include <stdexcept>
#include <string>

#include "layers/linear.h"

namespace kvserve {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("invalid model config: " + message);
}

}  // namespace

void ModelConfig::validate() const {
  require(vocab_size > 0, "vocab_size must be positive");
  require(hidden_size > 0, "hidden_size must be positive");
  bool any_mlp = false;
  for (int64_t l = 0; l < num_layers && !any_mlp; ++l) any_mlp = has_mlp(l);
  require(intermediate_size > 0 || !any_mlp, "intermediate_size must be positive");
  require(num_layers >= 0, "num_hidden_layers must be >= 0");
  require(num_heads > 0, "num_attention_heads must be positive");
  require(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
          "num_key_value_heads (" + std::to_string(num_kv_heads) +
              ") must divide num_attention_heads (" + std::to_string(num_heads) + ")");
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be positive and even");
  require(rms_norm_eps > 0, "rms_norm_eps must be positive");
  require(rope_theta > 0, "rope_theta must be positive");
  require(sliding_windows.empty() || static_cast<int64_t>(sliding_windows.size()) == num_layers,
          "sliding_windows must have one entry per layer");
  if (gated_mlp) {
    require(hidden_act == "silu" || hidden_act == "gelu_pytorch_tanh",
            "hidden_act must be silu or gelu_pytorch_tanh, got " + hidden_act);
  } else {
    require(hidden_act == "relu2", "an MLP without a gate takes relu2, got " + hidden_act);
  }
  require(rope_local_theta >= 0 && query_pre_attn_scalar >= 0 && attn_logit_softcap >= 0 &&
              final_logit_softcap >= 0 && embedding_multiplier > 0,
          "rope_local_theta, query_pre_attn_scalar and the soft-caps must be >= 0, "
          "embedding_multiplier positive");
  require(residual_multiplier > 0 && logits_scaling > 0,
          "residual_multiplier and logits_scaling must be positive");
  require(!(post_norms && sandwich_norms), "post_norms and sandwich_norms exclude each other");
  require(!qk_norm_full_width || qk_norm, "qk_norm_full_width needs qk_norm");
  require(norm_type == "rms_norm" || norm_type == "layer_norm",
          "norm_type must be rms_norm or layer_norm, got " + norm_type);
  require(norm_type == "rms_norm" || norm_weight_offset == 0.0,
          "a norm weight offset applies to RMSNorms only");
  require(!parallel_block || (!sandwich_norms && !post_norms && residual_multiplier == 1.0 &&
                              ssm.layers.empty()),
          "a parallel block has one norm before attention and MLP, no residual multiplier and "
          "no state-space mixers");
  require(nope_layers.empty() || static_cast<int64_t>(nope_layers.size()) == num_layers,
          "nope_layers must have one entry per layer");
  for (int64_t l = 0; l < num_layers; ++l) {
    require(uses_rope(l) || !qk_norm, "q/k norms without RoPE are not supported");
  }
  require(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
          "rotary_dim must be even and in [0, head_dim]");
  require(rotary_dim == 0 || !use_mla(), "partial rotary with MLA is not supported");
  if (!kv_sources.empty()) {
    require(static_cast<int64_t>(kv_sources.size()) == num_layers,
            "kv_sources must have one entry per layer");
    for (int64_t l = 0; l < num_layers; ++l) {
      const int64_t s = kv_sources[l];
      require(s >= 0 && s <= l && kv_sources[s] == s,
              "layer " + std::to_string(l) + " shares the KV of layer " + std::to_string(s) +
                  ", which must be an earlier layer that owns its KV");
      require(sliding_windows.empty() || sliding_windows[s] == sliding_windows[l],
              "layer " + std::to_string(l) + " shares the KV of a layer with another window");
    }
    require(!use_mla(), "kv_sharing is not supported with multi-head latent attention");
  }
  if (use_mla()) {
    require(mla.q_lora_rank >= 0 && mla.qk_nope_head_dim > 0 && mla.v_head_dim > 0,
            "q_lora_rank must be >= 0, qk_nope_head_dim and v_head_dim positive");
    require(mla.qk_rope_head_dim > 0 && mla.qk_rope_head_dim == head_dim,
            "qk_rope_head_dim must be positive and equal head_dim (the RoPE size)");
  }
  if (!ssm.layers.empty()) {
    require(static_cast<int64_t>(ssm.layers.size()) == num_layers,
            "the SSM layer list must have one entry per layer");
    require(ssm.num_heads > 0 && ssm.head_dim > 0 && ssm.state_size > 0,
            "the SSM mixer's num_heads, head_dim and state_size must be positive");
    require(ssm.n_groups > 0 && ssm.num_heads % ssm.n_groups == 0,
            "the SSM mixer's n_groups must divide its num_heads");
    require(ssm.norm_groups > 0 && ssm.inner_size() % ssm.norm_groups == 0,
            "the SSM mixer's norm groups must divide num_heads * head_dim");
    require(ssm.conv_kernel >= 2 && ssm.conv_kernel <= 16,
            "the SSM mixer's conv_kernel must be in [2, 16]");
    require(ssm.dt_min >= 0 && ssm.dt_max > ssm.dt_min,
            "the SSM mixer's time step limits must satisfy 0 <= min < max");
    require(ssm.kind == "mamba2" || ssm.kind == "mamba",
            "the SSM mixer's kind must be mamba2 or mamba");
    require(ssm.dt_bc_norm == "none" || ssm.dt_bc_norm == "weighted" || ssm.dt_bc_norm == "plain",
            "the SSM mixer's dt_bc_norm must be none, weighted or plain");
    if (ssm.kind == "mamba") {
      require(ssm.head_dim == 1 && ssm.n_groups == 1 && ssm.norm == "gate_only",
              "a Mamba mixer has a head a channel (head_dim 1), one group and the gate alone");
      require(ssm.time_step_rank > 0, "a Mamba mixer's time_step_rank must be positive");
      require(ssm.dt_bc_norm_eps > 0, "a Mamba mixer's dt/B/C norm epsilon must be positive");
    } else {
      require(ssm.dt_bc_norm == "none", "dt_bc_norm is a Mamba mixer's option");
    }
    for (int64_t l = 0; l < num_layers; ++l) {
      require(ssm.layers[l] >= 0 && ssm.layers[l] <= 3,
              "the SSM layer list holds 0 (attention), 1 (mixer), 2 (both) or 3 (an MLP alone) "
              "per layer");
      require(!has_mixer(l) || kv_sources.empty() || kv_sources[l] == l,
              "an SSM layer cannot share another layer's KV");
    }
    require(ssm.norm == "gate_then_norm" || ssm.norm == "norm_then_gate" ||
                ssm.norm == "gate_only",
            "the SSM mixer's norm must be gate_then_norm, norm_then_gate or gate_only, got '" +
                ssm.norm + "'");
    require(!use_mla(), "SSM layers are not supported with multi-head latent attention");
  }
  try {
    quant_scheme_from_name(quantization.scheme);
  } catch (const std::invalid_argument& e) {
    require(false, e.what());
  }
  require(quantization.outlier_threshold >= 0, "the quantization's outlier_threshold must be >= 0");
  require(quantization.activation == "exact" || quantization.activation == "int8",
          "the quantization's activation must be exact or int8, got '" + quantization.activation +
              "'");
  if (moe.num_experts > 0) {
    require(moe.num_experts_per_tok >= 1 && moe.num_experts_per_tok <= moe.num_experts,
            "num_experts_per_tok must be in [1, num_experts]");
    require(moe.moe_intermediate_size > 0, "moe_intermediate_size must be positive");
    require(moe.shared_intermediate_size >= 0, "the shared experts' size must be >= 0");
    require(moe.scoring_func == "softmax" || moe.scoring_func == "sigmoid",
            "scoring_func must be softmax or sigmoid, got " + moe.scoring_func);
    require(moe.activation == "silu" || moe.activation == "clamped_swiglu" ||
                moe.activation == "relu2",
            "the experts' activation must be silu, clamped_swiglu or relu2, got " +
                moe.activation);
    require(moe.latent_size >= 0, "the experts' latent size must be >= 0");
    require(moe.n_group >= 1 && moe.num_experts % moe.n_group == 0,
            "n_group must divide the number of routed experts");
    require(moe.topk_group >= 1 && moe.topk_group <= moe.n_group,
            "topk_group must be in [1, n_group]");
    require(moe.num_experts_per_tok <= moe.topk_group * (moe.num_experts / moe.n_group),
            "the topk_group groups must hold num_experts_per_tok experts");
    require(static_cast<int64_t>(moe.layers.size()) == num_layers,
            "the MoE layer list must have one entry per layer");
  }
}

int64_t ModelConfig::num_ssm_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += has_mixer(l);
  return n;
}

int64_t ModelConfig::num_kv_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += has_attention(l) && kv_source(l) == l;
  return n;
}

int64_t ModelConfig::kv_cache_index(int64_t layer) const {
  const int64_t source = kv_source(layer);
  int64_t index = 0;
  for (int64_t l = 0; l < source; ++l) index += has_attention(l) && kv_source(l) == l;
  return index;
}

int64_t ModelConfig::state_cache_index(int64_t layer) const {
  int64_t index = num_kv_layers();
  for (int64_t l = 0; l < layer; ++l) index += has_mixer(l);
  return index;
}

}  // namespace kvserve
