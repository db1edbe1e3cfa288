#pragma once
// A tiny random Llama built in C++ for the runner and engine tests (no checkpoint files), and the
// greedy sampling parameters those tests decode with.

#include <ATen/TensorOperators.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>

#include <string>
#include <unordered_map>

#include "kvserve/model_config.h"
#include "kvserve/sampling_params.h"

namespace kvserve {

inline ModelConfig tiny_config() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 128;
  c.sliding_windows = {0, 0};
  return c;
}

inline std::unordered_map<std::string, at::Tensor> tiny_weights(const ModelConfig& c) {
  at::manual_seed(0);
  const int64_t h = c.hidden_size, qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  std::unordered_map<std::string, at::Tensor> w{
      {"embed_tokens.weight", at::randn({c.vocab_size, h})},
      {"norm.weight", at::ones({h})},
      {"lm_head.weight", at::randn({c.vocab_size, h}) * 0.3},
  };
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    w[p + "input_layernorm.weight"] = at::ones({h});
    w[p + "post_attention_layernorm.weight"] = at::ones({h});
    w[p + "self_attn.qkv_proj.weight"] = at::randn({qkv, h}) * 0.3;
    w[p + "self_attn.o_proj.weight"] = at::randn({h, c.num_heads * c.head_dim}) * 0.3;
    w[p + "mlp.gate_up_proj.weight"] = at::randn({2 * c.intermediate_size, h}) * 0.3;
    w[p + "mlp.down_proj.weight"] = at::randn({h, c.intermediate_size}) * 0.3;
  }
  return w;
}

/// Greedy decoding of exactly max_tokens tokens (EOS ignored).
inline SamplingParams greedy(int64_t max_tokens) {
  SamplingParams p;
  p.temperature = 0.0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

}  // namespace kvserve
