#pragma once
// Argument checks of kv_cache_write shared by its CPU and CUDA launchers (shapes, dtypes,
// devices; the slots' range is checked on the host by the CPU launcher alone).

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace kv_cache_write_checks {

constexpr const char* kOp = "kv_cache_write";

inline void check_token_rows(const char* name, const at::Tensor& t, const at::Tensor& cache) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == cache.size(2) && t.size(2) == cache.size(3), kOp, ": ",
              name, " must be [T, ", cache.size(2), ", ", cache.size(3), "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), kOp, ": ", name,
              " must have contiguous heads");
  TORCH_CHECK(t.device() == cache.device(), kOp, ": ", name, " is on ", t.device(),
              ", the cache on ", cache.device());
}

}  // namespace kv_cache_write_checks

/// Checks every argument but the slots' values; returns the caches' format.
inline cpu::KVCacheFormat check_kv_cache_write(const at::Tensor& key, const at::Tensor& value,
                                               const at::Tensor& key_cache,
                                               const at::Tensor& value_cache,
                                               const at::Tensor& slot_mapping,
                                               const std::optional<at::Tensor>& key_scale,
                                               const std::optional<at::Tensor>& value_scale) {
  using namespace kv_cache_write_checks;
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(),
              kOp, ": caches must be contiguous [num_blocks, block_size, heads, head_dim]");
  check_like(kOp, "value_cache", value_cache, key_cache);
  check_token_rows("key", key, key_cache);
  check_token_rows("value", value, key_cache);
  check_like(kOp, "value", value, key);
  const cpu::KVCacheFormat format =
      check_kv_cache_format(kOp, "key_cache", key_cache, key.scalar_type(), key_scale);
  check_kv_cache_format(kOp, "value_cache", value_cache, key.scalar_type(), value_scale);
  check_contiguous(kOp, "slot_mapping", slot_mapping, at::kLong);
  TORCH_CHECK(key.size(0) == slot_mapping.numel() && value.size(0) == slot_mapping.numel(), kOp,
              ": key, value and slot_mapping disagree on the number of tokens");
  TORCH_CHECK(slot_mapping.device() == key.device(), kOp, ": slot_mapping is on ",
              slot_mapping.device(), ", key on ", key.device());
  TORCH_CHECK(format == cpu::KVCacheFormat::kPlain ||
                  value_cache.data_ptr() != key_cache.data_ptr() ||
                  key_scale->data_ptr() == value_scale->data_ptr(),
              kOp, ": a latent cache (one cache passed twice) takes one scale tensor for both");
  return format;
}

}  // namespace kvserve::ops
