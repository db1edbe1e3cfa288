#include "kvserve/model_config.h"

#include <stdexcept>
#include <string>

namespace kvserve {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("invalid model config: " + message);
}

}  // namespace

void ModelConfig::validate() const {
  require(vocab_size > 0, "vocab_size must be positive");
  require(hidden_size > 0, "hidden_size must be positive");
  require(intermediate_size > 0, "intermediate_size must be positive");
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
}

}  // namespace kvserve
