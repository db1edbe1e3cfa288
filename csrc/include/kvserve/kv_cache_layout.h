#pragma once
// What one token's KV entry looks like in every layer: the shape that the caches allocate and the
// attention reads. Plain attention keeps a key and a value per KV head; multi-head latent
// attention (MLA) keeps one latent per token that serves as both.

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "kvserve/model_config.h"

namespace kvserve {

/// Per layer and token: key [num_kv_heads, head_dim] and value [num_kv_heads, value_head_dim], or
/// (latent) one entry [1, head_dim] whose first value_head_dim elements are the value.
struct KVCacheLayout {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;        ///< key head size; the whole latent (kv_lora_rank + rope) for MLA
  int64_t value_head_dim = 0;  ///< value head size; kv_lora_rank for MLA
  bool latent = false;         ///< one tensor per layer, read as both key and value (MLA)

  /// Plain attention: num_layers layers of num_kv_heads heads of head_dim (key and value).
  static KVCacheLayout plain(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim);
  /// The layout a model of this config caches: its latents under MLA, else its K/V heads; one
  /// layer per cache (layers that share another layer's KV have none).
  static KVCacheLayout for_model(const ModelConfig& config);
  /// The layout the same model would need with plain multi-head K/V in every layer (MLA
  /// expanded: num_heads keys of qk_nope + qk_rope and values of v_head_dim; no KV sharing).
  static KVCacheLayout multi_head_equivalent(const ModelConfig& config);

  /// Elements per token and layer, key and value together.
  int64_t elements_per_token_per_layer() const;
  /// Bytes per token over all layers.
  int64_t bytes_per_token(at::ScalarType dtype) const;
  /// Throws std::invalid_argument on a non-positive size or a value wider than a latent.
  void validate() const;
};

}  // namespace kvserve
