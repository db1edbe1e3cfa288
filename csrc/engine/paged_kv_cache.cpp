#include "kvserve/paged_kv_cache.h"

#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>

#include <stdexcept>
#include <string>

#include "kernels/cache/kv_cache_copy_blocks.h"

namespace kvserve {

PagedKVCache::PagedKVCache(const KVCacheLayout& layout, int64_t num_blocks, int64_t block_size,
                           at::ScalarType dtype, at::Device device, StatePoolOptions states)
    : layout_(layout),
      num_blocks_(num_blocks),
      block_size_(block_size),
      dtype_(dtype),
      device_(device),
      states_(states) {
  layout.validate();
  if (block_size < 1) throw std::invalid_argument("PagedKVCache: block_size must be positive");
  if (num_blocks < 2) {
    throw std::invalid_argument("PagedKVCache: need at least 2 blocks (block 0 is the null "
                                "block), got " + std::to_string(num_blocks));
  }
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  // Zero-filled, so that the whole pool is committed now: the operating system maps a page of an
  // untouched allocation at its first write, and on CPU those faults would otherwise land in the
  // steps that first write each block (~0.8 s per GiB on a virtual machine). A pool that does not
  // fit in memory fails here, not in the middle of serving.
  for (int64_t s = 0; s < layout.num_slots(); ++s) {
    at::Tensor key = at::zeros({num_blocks, block_size, layout.num_kv_heads, layout.head_dim},
                               options);
    at::Tensor value =
        layout.latent ? key
                      : at::zeros({num_blocks, block_size, layout.num_kv_heads,
                                   layout.value_head_dim},
                                  options);
    LayerKVCache slot;
    slot.key = std::move(key);
    slot.value = std::move(value);
    if (is_quantized_kv_dtype(dtype)) {  // fp32 scales, one per (token, KV head)
      const auto scale_options = options.dtype(at::kFloat);
      slot.key_scale = at::zeros({num_blocks, block_size, layout.num_kv_heads}, scale_options);
      slot.value_scale = layout.latent ? slot.key_scale
                                       : at::zeros({num_blocks, block_size, layout.num_kv_heads},
                                                   scale_options);
    }
    slots_.push_back(std::move(slot));
  }
  // Grouped layers share the slots: the i-th layer of every group is in slot i.
  layers_.resize(layout.num_layers);
  if (layout.groups.empty()) {
    layers_ = slots_;
  } else {
    for (size_t g = 0; g < layout.groups.size(); ++g) {
      const std::vector<int64_t>& group = layout.groups[g].layers;
      for (size_t i = 0; i < group.size(); ++i) {
        layers_[group[i]] = slots_[i];
        layers_[group[i]].group = static_cast<int64_t>(g);
      }
    }
  }
  if (!layout.has_state()) return;
  if (states.num_slots < 1) {
    throw std::invalid_argument("PagedKVCache: a model with state layers needs at least one "
                                "state slot, got " + std::to_string(states.num_slots));
  }
  if (states.ssm_dtype != at::kFloat && states.ssm_dtype != states.conv_dtype) {
    throw std::invalid_argument("PagedKVCache: the SSM state is fp32 or the model's dtype");
  }
  num_state_slots_ = states.num_slots;
  const KVCacheStateGroup& g = layout.state;
  for (int64_t l = 0; l < g.num_layers(); ++l) {
    LayerKVCache state;
    state.key = at::zeros({states.num_slots, g.conv_dim, g.conv_kernel - 1},
                          options.dtype(states.conv_dtype));
    state.value = at::zeros({states.num_slots, g.num_heads, g.head_dim, g.state_size},
                            options.dtype(states.ssm_dtype));
    state.group = kStateGroup;
    layers_.push_back(std::move(state));
  }
}

PagedKVCache::PagedKVCache(int64_t num_layers, int64_t num_blocks, int64_t block_size,
                           int64_t num_kv_heads, int64_t head_dim, at::ScalarType dtype,
                           at::Device device)
    : PagedKVCache(KVCacheLayout::plain(num_layers, num_kv_heads, head_dim), num_blocks,
                   block_size, dtype, device) {}

int64_t PagedKVCache::bytes_per_block(const KVCacheLayout& layout, int64_t block_size,
                                      at::ScalarType dtype) {
  return block_size * layout.bytes_per_slot_token(dtype);
}

PagedKVCache PagedKVCache::from_memory(int64_t memory_bytes, const KVCacheLayout& layout,
                                       int64_t block_size, at::ScalarType dtype,
                                       at::Device device) {
  const int64_t per_block = bytes_per_block(layout, block_size, dtype);
  const int64_t num_blocks = per_block > 0 ? memory_bytes / per_block : 0;
  if (num_blocks < 2) {
    throw std::invalid_argument(
        "PagedKVCache: " + std::to_string(memory_bytes) + " bytes hold " +
        std::to_string(num_blocks) + " blocks of " + std::to_string(per_block) +
        " bytes; at least 2 are needed (block 0 is the null block)");
  }
  return PagedKVCache(layout, num_blocks, block_size, dtype, device);
}

int64_t PagedKVCache::bytes_per_token() const { return layout_.bytes_per_slot_token(dtype()); }

int64_t PagedKVCache::nbytes() const {
  return bytes_per_token() * block_size() * num_blocks() +
         state_bytes_per_sequence() * num_state_slots_;
}

int64_t PagedKVCache::state_bytes_per_sequence() const {
  if (!layout_.has_state()) return 0;
  return layout_.state.bytes_per_sequence(states_.conv_dtype, states_.ssm_dtype);
}

void PagedKVCache::copy_states(const std::vector<std::pair<int32_t, int32_t>>& copies) {
  if (copies.empty()) return;
  for (const auto& [src, dst] : copies) {
    if (src < 0 || dst < 0 || src >= num_state_slots_ || dst >= num_state_slots_) {
      throw std::out_of_range("PagedKVCache::copy_states: slot " +
                              std::to_string(src < 0 || src >= num_state_slots_ ? src : dst) +
                              " is outside the pool's " + std::to_string(num_state_slots_));
    }
  }
  for (size_t l = layout_.num_layers; l < layers_.size(); ++l) {
    for (const auto& [src, dst] : copies) {
      layers_[l].key[dst].copy_(layers_[l].key[src]);
      layers_[l].value[dst].copy_(layers_[l].value[src]);
    }
  }
}

void PagedKVCache::copy_blocks(const std::vector<std::pair<int32_t, int32_t>>& copies) {
  if (copies.empty() || slots_.empty()) return;
  std::vector<int64_t> flat;
  flat.reserve(2 * copies.size());
  for (const auto& [src, dst] : copies) {
    flat.push_back(src);
    flat.push_back(dst);
  }
  // On the host: a CUDA launcher checks it there and uploads it (no device read-back).
  const at::Tensor mapping = at::tensor(flat, at::TensorOptions().dtype(at::kLong)).view({-1, 2});
  std::vector<at::Tensor> keys, values;  // no values for latent layers: the key is the entry
  std::vector<at::Tensor> key_scales, value_scales;  // as [num_blocks, block_size, heads, 1]
  for (const LayerKVCache& slot : slots_) {
    keys.push_back(slot.key);
    if (!layout_.latent) values.push_back(slot.value);
    if (slot.key_scale.defined()) {
      key_scales.push_back(slot.key_scale.unsqueeze(-1));
      if (!layout_.latent) value_scales.push_back(slot.value_scale.unsqueeze(-1));
    }
  }
  ops::kv_cache_copy_blocks(keys, values, mapping);
  if (!key_scales.empty()) ops::kv_cache_copy_blocks(key_scales, value_scales, mapping);
}

}  // namespace kvserve
