#pragma once
// The paged KV cache: per layer, one pool of fixed-size blocks that sequences share through their
// block tables. The tensors live here; which block belongs to whom is PagedBlockManager's business
// (block ids only). Block 0 is the null block that pads block tables; it holds no tokens.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/kv_cache_layout.h"

namespace kvserve {

/// The state pool beside the blocks, for a layout with a state group: num_slots slots per state
/// layer, one per running sequence (PagedBlockManager hands them out).
struct StatePoolOptions {
  int64_t num_slots = 0;
  at::ScalarType conv_dtype = at::kFloat;  ///< the model's dtype
  at::ScalarType ssm_dtype = at::kFloat;   ///< fp32, or the model's dtype
};

/// LayerKVCache::group of a state layer's entry: key is its conv state
/// [slots, conv_dim, conv_kernel - 1], value its SSM state [slots, heads, head_dim, state_size].
constexpr int64_t kStateGroup = -1;

/// A step's copies in the pool besides its forward's writes (src -> dst): the copy-on-write
/// blocks and the state slots copied before it (a forked sequence's state, a prefix hit's saved
/// one), the states saved at block boundaries after it.
struct StepCopies {
  std::vector<std::pair<int32_t, int32_t>> blocks, states, snapshots;
};

class PagedKVCache {
 public:
  /// Allocates num_blocks blocks per slot (zero-filled): per slot key
  /// [num_blocks, block_size, num_kv_heads, head_dim] and value
  /// [num_blocks, block_size, num_kv_heads, value_head_dim], or for a latent layout one tensor
  /// [num_blocks, block_size, 1, head_dim] that is both. A slot per layer; with grouped layers
  /// (layout.groups), the i-th layer of every group shares slot i, and a block id is one block
  /// of each layer of the group that holds it. Throws std::invalid_argument on sizes < 1 or
  /// fewer than 2 blocks (block 0 is reserved). A layout with a state group also gets
  /// `states.num_slots` (>= 1) zeroed state slots in each of its state layers.
  PagedKVCache(const KVCacheLayout& layout, int64_t num_blocks, int64_t block_size,
               at::ScalarType dtype, at::Device device, StatePoolOptions states = {});
  /// The plain layout: num_layers layers of num_kv_heads heads of head_dim.
  PagedKVCache(int64_t num_layers, int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
               int64_t head_dim, at::ScalarType dtype, at::Device device);

  /// As many blocks as fit in `memory_bytes` (all layers).
  static PagedKVCache from_memory(int64_t memory_bytes, const KVCacheLayout& layout,
                                  int64_t block_size, at::ScalarType dtype, at::Device device);

  /// Bytes one block takes over all layers (key + value, or the latents).
  static int64_t bytes_per_block(const KVCacheLayout& layout, int64_t block_size,
                                 at::ScalarType dtype);

  /// The per-layer views the model's attention reads and writes, with their group (a latent
  /// layer's key and value are the same tensor; grouped layers share slots), followed by one
  /// entry per state layer (group kStateGroup): the caches a forward takes, in
  /// ModelConfig::kv_cache_index order.
  const std::vector<LayerKVCache>& layers() const { return layers_; }

  /// Copies whole state slots (src -> dst) in every state layer: a forked sequence's state.
  void copy_states(const std::vector<std::pair<int32_t, int32_t>>& copies);
  /// State slots per state layer (0 without a state group).
  int64_t num_state_slots() const { return num_state_slots_; }
  /// Bytes of one sequence's states over all state layers (0 without a state group).
  int64_t state_bytes_per_sequence() const;

  /// Copies whole blocks (src -> dst) in every slot: the copy-on-write copies the block manager
  /// lists. Throws (c10::Error) on ids outside the pool.
  void copy_blocks(const std::vector<std::pair<int32_t, int32_t>>& copies);

  const KVCacheLayout& layout() const { return layout_; }
  /// Layers with a KV cache (the state layers not counted).
  int64_t num_layers() const { return layout_.num_layers; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  int64_t num_kv_heads() const { return layout_.num_kv_heads; }
  int64_t head_dim() const { return layout_.head_dim; }
  at::ScalarType dtype() const { return dtype_; }
  at::Device device() const { return device_; }
  /// Tokens the usable blocks (all but the null block) can hold.
  int64_t capacity_tokens() const { return (num_blocks() - 1) * block_size(); }
  /// KV bytes per token of a block id: over all layers, or over one group's slots when grouped.
  int64_t bytes_per_token() const;
  /// Bytes of all tensors, the state pool's included.
  int64_t nbytes() const;

 private:
  KVCacheLayout layout_;
  int64_t num_blocks_, block_size_, num_state_slots_ = 0;
  at::ScalarType dtype_;
  at::Device device_;
  StatePoolOptions states_;
  std::vector<LayerKVCache> slots_;   // the tensors
  std::vector<LayerKVCache> layers_;  // per layer: its slot's tensors and its group
};

}  // namespace kvserve
