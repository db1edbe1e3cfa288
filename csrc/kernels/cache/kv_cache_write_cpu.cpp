// CPU implementation of kv_cache_write: one row copy per token (memcpy is already vectorized).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "kernels/cache/kv_cache_write.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void check_token_rows(const char* name, const at::Tensor& t, const at::Tensor& cache) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == cache.size(2) && t.size(2) == cache.size(3),
              "kv_cache_write: ", name, " must be [T, ", cache.size(2), ", ", cache.size(3),
              "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "kv_cache_write: ", name,
              " must have contiguous heads");
  check_like("kv_cache_write", name, t, cache);
}

void kv_cache_write_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(),
              "kv_cache_write: caches must be contiguous [num_blocks, block_size, heads, head_dim]");
  check_like("kv_cache_write", "value_cache", value_cache, key_cache);
  check_token_rows("key", key, key_cache);
  check_token_rows("value", value, key_cache);
  check_contiguous("kv_cache_write", "slot_mapping", slot_mapping, at::kLong);
  const int64_t num_tokens = slot_mapping.numel();
  TORCH_CHECK(key.size(0) == num_tokens && value.size(0) == num_tokens,
              "kv_cache_write: key, value and slot_mapping disagree on the number of tokens");

  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "kv_cache_write: slot ", slots[t],
                " is outside the cache of ", num_slots, " slots");
  }
  const int64_t elem = key.element_size();
  const int64_t row_bytes = key_cache.size(2) * key_cache.size(3) * elem;
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const bool latent = vc == kc;  // one entry per token: the value lives inside the key
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(kc + slots[t] * row_bytes, k + t * key.stride(0) * elem, row_bytes);
      if (!latent) std::memcpy(vc + slots[t] * row_bytes, v + t * value.stride(0) * elem, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("kv_cache_write", &kv_cache_write_cpu); }

}  // namespace kvserve::ops
