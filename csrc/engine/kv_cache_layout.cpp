#include "kvserve/kv_cache_layout.h"

#include <stdexcept>

namespace kvserve {

KVCacheLayout KVCacheLayout::plain(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim) {
  return {num_layers, num_kv_heads, head_dim, head_dim, false};
}

KVCacheLayout KVCacheLayout::for_model(const ModelConfig& c) {
  if (!c.use_mla()) return plain(c.num_kv_layers(), c.num_kv_heads, c.head_dim);
  return {c.num_layers, 1, c.mla.kv_lora_rank + c.mla.qk_rope_head_dim, c.mla.kv_lora_rank, true};
}

KVCacheLayout KVCacheLayout::multi_head_equivalent(const ModelConfig& c) {
  if (!c.use_mla()) return plain(c.num_layers, c.num_kv_heads, c.head_dim);
  return {c.num_layers, c.num_heads, c.mla.qk_head_dim(), c.mla.v_head_dim, false};
}

int64_t KVCacheLayout::elements_per_token_per_layer() const {
  return latent ? num_kv_heads * head_dim : num_kv_heads * (head_dim + value_head_dim);
}

int64_t KVCacheLayout::bytes_per_token(at::ScalarType dtype) const {
  return num_layers * elements_per_token_per_layer() *
         static_cast<int64_t>(c10::elementSize(dtype));
}

void KVCacheLayout::validate() const {
  if (num_layers < 1 || num_kv_heads < 1 || head_dim < 1 || value_head_dim < 1) {
    throw std::invalid_argument("KV cache layout: num_layers, num_kv_heads, head_dim and "
                                "value_head_dim must be positive");
  }
  if (latent && (num_kv_heads != 1 || value_head_dim > head_dim)) {
    throw std::invalid_argument("KV cache layout: a latent cache has one head whose value is a "
                                "prefix of its entry");
  }
}

}  // namespace kvserve
