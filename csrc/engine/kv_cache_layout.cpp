#include "kvserve/kv_cache_layout.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace kvserve {

KVCacheLayout KVCacheLayout::plain(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim) {
  return {num_layers, num_kv_heads, head_dim, head_dim, false};
}

KVCacheLayout KVCacheLayout::for_model(const ModelConfig& c, bool group_sliding_windows) {
  if (c.use_mla()) {
    return {c.num_layers, 1, c.mla.kv_lora_rank + c.mla.qk_rope_head_dim, c.mla.kv_lora_rank,
            true};
  }
  KVCacheLayout layout = plain(c.num_kv_layers(), c.num_kv_heads, c.head_dim);
  if (c.num_ssm_layers() > 0) {
    KVCacheStateGroup& state = layout.state;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      if (c.has_mixer(l)) state.layers.push_back(l);
    }
    state.conv_dim = c.ssm.conv_dim();
    state.conv_kernel = c.ssm.conv_kernel;
    state.num_heads = c.ssm.num_heads;
    state.head_dim = c.ssm.head_dim;
    state.state_size = c.ssm.state_size;
  }
  if (!group_sliding_windows || c.sliding_windows.empty()) return layout;
  // Cache indices by window, windows in order of first appearance.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> kinds;
  for (int64_t l = 0, index = 0; l < c.num_layers; ++l) {
    if (!c.has_attention(l) || c.kv_source(l) != l) continue;
    const int64_t w = c.sliding_windows[l];
    auto it = std::find_if(kinds.begin(), kinds.end(), [w](const auto& k) { return k.first == w; });
    if (it == kinds.end()) it = kinds.insert(kinds.end(), {w, {}});
    it->second.push_back(index++);
  }
  // No attention layers, or full attention only.
  if (kinds.empty() || (kinds.size() == 1 && kinds[0].first == 0)) return layout;
  size_t size = kinds[0].second.size();
  for (const auto& kind : kinds) size = std::min(size, kind.second.size());
  for (const auto& [window, layers] : kinds) {
    for (size_t i = 0; i < layers.size(); i += size) {
      const size_t end = std::min(layers.size(), i + size);
      layout.groups.push_back({window, {layers.begin() + i, layers.begin() + end}});
    }
  }
  return layout;
}

KVCacheLayout KVCacheLayout::multi_head_equivalent(const ModelConfig& c) {
  if (!c.use_mla()) return plain(c.num_layers, c.num_kv_heads, c.head_dim);
  return {c.num_layers, c.num_heads, c.mla.qk_head_dim(), c.mla.v_head_dim, false};
}

int64_t KVCacheLayout::elements_per_token_per_layer() const {
  return latent ? num_kv_heads * head_dim : num_kv_heads * (head_dim + value_head_dim);
}

int64_t KVCacheLayout::bytes_per_token_per_layer(at::ScalarType dtype) const {
  const int64_t scales = is_quantized_kv_dtype(dtype) ? (latent ? 1 : 2) * num_kv_heads : 0;
  return elements_per_token_per_layer() * static_cast<int64_t>(c10::elementSize(dtype)) +
         scales * static_cast<int64_t>(sizeof(float));
}

int64_t KVCacheLayout::bytes_per_token(at::ScalarType dtype) const {
  return num_layers * bytes_per_token_per_layer(dtype);
}

int64_t KVCacheLayout::num_slots() const {
  if (groups.empty()) return num_layers;
  int64_t slots = 0;
  for (const KVCacheGroup& g : groups) slots = std::max<int64_t>(slots, g.layers.size());
  return slots;
}

int64_t KVCacheLayout::bytes_per_slot_token(at::ScalarType dtype) const {
  return num_slots() * bytes_per_token_per_layer(dtype);
}

std::vector<int64_t> KVCacheLayout::group_windows() const {
  if (groups.empty()) return {0};
  std::vector<int64_t> windows;
  for (const KVCacheGroup& g : groups) windows.push_back(g.sliding_window);
  return windows;
}

int64_t KVCacheStateGroup::bytes_per_sequence(at::ScalarType conv_dtype,
                                              at::ScalarType ssm_dtype) const {
  const int64_t conv = conv_dim * (conv_kernel - 1) * c10::elementSize(conv_dtype);
  const int64_t ssm = num_heads * head_dim * state_size * c10::elementSize(ssm_dtype);
  return num_layers() * (conv + ssm);
}

void KVCacheLayout::validate() const {
  if (num_layers < (has_state() ? 0 : 1) || num_kv_heads < 1 || head_dim < 1 ||
      value_head_dim < 1) {
    throw std::invalid_argument("KV cache layout: num_layers, num_kv_heads, head_dim and "
                                "value_head_dim must be positive");
  }
  if (has_state() && (state.conv_dim < 1 || state.conv_kernel < 2 || state.num_heads < 1 ||
                      state.head_dim < 1 || state.state_size < 1)) {
    throw std::invalid_argument("KV cache layout: the state group's sizes must be positive and "
                                "its conv_kernel at least 2");
  }
  std::vector<int64_t> seen(num_layers, 0);
  for (const KVCacheGroup& g : groups) {
    for (int64_t l : g.layers) {
      if (l < 0 || l >= num_layers || seen[l]++) {
        throw std::invalid_argument("KV cache layout: every layer must be in exactly one group");
      }
    }
  }
  if (!groups.empty() && std::count(seen.begin(), seen.end(), 1) != num_layers) {
    throw std::invalid_argument("KV cache layout: every layer must be in exactly one group");
  }
  if (latent && (num_kv_heads != 1 || value_head_dim > head_dim)) {
    throw std::invalid_argument("KV cache layout: a latent cache has one head whose value is a "
                                "prefix of its entry");
  }
}

}  // namespace kvserve
