#pragma once
// What one token's KV entry looks like in every layer: the shape that the caches allocate and the
// attention reads. Plain attention keeps a key and a value per KV head; multi-head latent
// attention (MLA) keeps one latent per token that serves as both.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "kvserve/model_config.h"

namespace kvserve {

/// Whether a KV cache of this dtype stores quantized entries with per-row scales (int8, fp8).
inline bool is_quantized_kv_dtype(at::ScalarType dtype) {
  return dtype == at::kChar || dtype == at::kFloat8_e4m3fn;
}

/// Layers of a paged pool that share block tables: the same sliding window (0: full attention).
/// `layers` are cache indices (layers that own their KV, in order).
struct KVCacheGroup {
  int64_t sliding_window = 0;
  std::vector<int64_t> layers;
};

/// The fixed-size states of a model's state-space mixer layers (ModelConfig::ssm), the "state"
/// kind of layer group: per layer and sequence a conv state [conv_dim, conv_kernel - 1] in the
/// model's dtype and an SSM state [num_heads, head_dim, state_size] (fp32 unless set otherwise).
/// A sequence holds one state slot in every such layer, whatever its length. Empty layers: none.
struct KVCacheStateGroup {
  std::vector<int64_t> layers;  ///< the model's layer indices, in order
  int64_t conv_dim = 0;
  int64_t conv_kernel = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;
  int64_t state_size = 0;

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  /// Bytes of one sequence's states over all the layers.
  int64_t bytes_per_sequence(at::ScalarType conv_dtype, at::ScalarType ssm_dtype) const;
};

/// Per layer and token: key [num_kv_heads, head_dim] and value [num_kv_heads, value_head_dim], or
/// (latent) one entry [1, head_dim] whose first value_head_dim elements are the value.
struct KVCacheLayout {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;        ///< key head size; the whole latent (kv_lora_rank + rope) for MLA
  int64_t value_head_dim = 0;  ///< value head size; kv_lora_rank for MLA
  bool latent = false;         ///< one tensor per layer, read as both key and value (MLA)
  /// How a paged pool groups the layers (vLLM's hybrid KV cache manager): by sliding window, in
  /// groups of at most num_slots() layers that share the pool's tensors; every group has its own
  /// block tables, and a block id holds one block of each of its group's layers. Empty: one
  /// full-attention group of all layers.
  std::vector<KVCacheGroup> groups;
  /// The state-space layers' states (hybrid and Mamba models); num_layers counts the attention
  /// layers only, and may be 0 when every layer keeps a state.
  KVCacheStateGroup state;

  /// Plain attention: num_layers layers of num_kv_heads heads of head_dim (key and value).
  static KVCacheLayout plain(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim);
  /// The layout a model of this config caches: its latents under MLA, else its K/V heads; one
  /// layer per cache (layers that share another layer's KV have none). With
  /// group_sliding_windows, layers whose windows differ (or are all sliding) are grouped: the
  /// smallest kind sets the group size (Gemma 2's 13 + 13 layers: 2 groups of 13; 5:1 with 6
  /// layers: 6 groups of 1), so that a local group keeps only its window.
  static KVCacheLayout for_model(const ModelConfig& config, bool group_sliding_windows = false);
  /// The layout the same model would need with plain multi-head K/V in every layer (MLA
  /// expanded: num_heads keys of qk_nope + qk_rope and values of v_head_dim; no KV sharing).
  static KVCacheLayout multi_head_equivalent(const ModelConfig& config);

  /// Elements per token and layer, key and value together.
  int64_t elements_per_token_per_layer() const;
  /// Bytes per token and layer in a cache of `dtype`: its entries, and for int8 / fp8 caches an
  /// fp32 scale per KV head of the key and of the value (one per token for a latent).
  int64_t bytes_per_token_per_layer(at::ScalarType dtype) const;
  /// Bytes per token over all layers.
  int64_t bytes_per_token(at::ScalarType dtype) const;
  /// Tensors of a paged pool: the largest group's layers (num_layers without groups).
  int64_t num_slots() const;
  /// Bytes per token of one block id of a paged pool: one token in each of num_slots() layers.
  int64_t bytes_per_slot_token(at::ScalarType dtype) const;
  /// The sliding window of each group ({0} without groups).
  std::vector<int64_t> group_windows() const;
  bool has_state() const { return state.num_layers() > 0; }
  /// Throws std::invalid_argument on a non-positive size or a value wider than a latent.
  void validate() const;
};

}  // namespace kvserve
