#pragma once
// What one forward pass needs to know about the flattened batch besides its tokens.

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace kvserve {

/// Attention metadata of one flattened batch of T tokens from B sequences (see paged_attention.h).
struct AttentionMetadata {
  at::Tensor slot_mapping;     ///< int64 [T]: cache slot of each token's K/V; -1 = do not write
  at::Tensor query_start_loc;  ///< int32 [B + 1]: token offsets of each sequence's queries
  at::Tensor seq_lens;         ///< int32 [B]: context length of each sequence after this step
  at::Tensor block_tables;     ///< int32 [B, max_blocks_per_seq]: cache blocks of each sequence
  /// The three above on the host, where a model plans its batch from them (MLABatchPlan) without
  /// waiting for the device: ForwardBatchBuilder's own bytes (the same tensors on the CPU).
  /// Undefined when whoever built the metadata gave none; a reader then copies the device ones.
  at::Tensor host_query_start_loc, host_seq_lens, host_block_tables;
  /// Groups 1.. of a pool whose layers are grouped (KVCacheLayout::groups): each group's own
  /// slot_mapping and block_tables; slot_mapping and block_tables above are group 0's.
  std::vector<at::Tensor> group_slot_mappings, group_block_tables;
  /// int32 [T]: the LoRA adapter slot of each token's request, -1 for none (CausalLM::set_lora);
  /// undefined when the model serves no adapters. Not attention's, but the batch's: it rides
  /// along to the projections.
  at::Tensor lora_slots;
  /// A model with state-space layers: int32 [B], each sequence's slot in the state pool, and
  /// bool [B], whether that slot holds the state of the sequence's earlier tokens (false for a
  /// sequence's first chunk: the slot's content is stale). Undefined otherwise.
  at::Tensor state_slots, has_initial_state;

  const at::Tensor& slots(int64_t group) const {
    return group == 0 ? slot_mapping : group_slot_mappings.at(group - 1);
  }
  const at::Tensor& tables(int64_t group) const {
    return group == 0 ? block_tables : group_block_tables.at(group - 1);
  }
};

/// One layer's cache as the attention sees it: key and value
/// [num_blocks, block_size, num_kv_heads, head_dim], and the group of layers whose slots and
/// block tables address it. A contiguous cache is the special case of one block per batch row,
/// max_seq_len tokens long. An int8 / fp8 cache has its fp32 scales beside it, one per
/// (token, KV head): key_scale / value_scale [num_blocks, block_size, num_kv_heads] (undefined
/// for a cache in the model's dtype; a latent cache's value_scale is its key_scale).
struct LayerKVCache {
  at::Tensor key;
  at::Tensor value;
  int64_t group = 0;
  at::Tensor key_scale;
  at::Tensor value_scale;

  /// The scales as the ops take them (nullopt for a cache in the model's dtype).
  std::optional<at::Tensor> key_scales() const {
    return key_scale.defined() ? std::optional<at::Tensor>(key_scale) : std::nullopt;
  }
  std::optional<at::Tensor> value_scales() const {
    return value_scale.defined() ? std::optional<at::Tensor>(value_scale) : std::nullopt;
  }
};

}  // namespace kvserve
