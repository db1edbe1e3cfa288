#pragma once
// Argument checks of paged_attention shared by its CPU and CUDA launchers: shapes, dtypes and
// devices. The metadata's values are checked on the host by the CPU launcher alone.

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace paged_attention_checks {

constexpr const char* kOp = "paged_attention";

inline void check_heads(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), kOp, ": ", name,
              " must be [num_tokens, num_heads, head_dim] with contiguous heads, got ", t.sizes());
}

}  // namespace paged_attention_checks

/// Checks every argument but the metadata's values; returns the caches' format.
inline cpu::KVCacheFormat check_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, const std::optional<at::Tensor>& key_scale,
    const std::optional<at::Tensor>& value_scale, const std::optional<at::Tensor>& sinks) {
  using namespace paged_attention_checks;
  check_heads("query", query);
  check_heads("out", out);
  check_like(kOp, "out", out, query);
  TORCH_CHECK(key_cache.device() == query.device() && value_cache.device() == query.device(),
              kOp, ": the caches must be on the query's device");
  const cpu::KVCacheFormat format =
      check_kv_cache_format(kOp, "key_cache", key_cache, query.scalar_type(), key_scale);
  TORCH_CHECK(check_kv_cache_format(kOp, "value_cache", value_cache, query.scalar_type(),
                                    value_scale) == format,
              kOp, ": key_cache and value_cache must be of one dtype");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == query.size(1), kOp,
              ": out must be [num_tokens, num_heads, value_head_dim] like query, got ", out.sizes(),
              " and ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.dim() == 4 &&
                  value_cache.is_contiguous() &&
                  value_cache.sizes().slice(0, 3) == key_cache.sizes().slice(0, 3),
              kOp, ": caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] ",
              "of one pool, got ", key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(out.size(2) >= 1 && out.size(2) <= value_cache.size(3), kOp, ": out's head_dim ",
              out.size(2), " must be in [1, value_cache's head_dim ", value_cache.size(3), "]");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == query.size(2), kOp, ": cache head_dim ", key_cache.size(3),
              " differs from query head_dim ", query.size(2));
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, kOp, ": num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  if (sinks) {
    check_contiguous(kOp, "sinks", *sinks, at::kFloat);
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads &&
                    sinks->device() == query.device(),
                kOp, ": sinks must be [num_heads = ", num_heads, "] on ", query.device(),
                ", got ", sinks->sizes());
  }
  check_contiguous(kOp, "query_start_loc", query_start_loc, at::kInt);
  check_contiguous(kOp, "seq_lens", seq_lens, at::kInt);
  check_contiguous(kOp, "block_tables", block_tables, at::kInt);
  TORCH_CHECK(query_start_loc.device() == query.device() && seq_lens.device() == query.device() &&
                  block_tables.device() == query.device(),
              kOp, ": query_start_loc, seq_lens and block_tables must be on ", query.device());
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, kOp, ": query_start_loc must have ",
              seq_lens.numel() + 1, " entries");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.numel(), kOp,
              ": block_tables must be [num_seqs, max_blocks_per_seq]");
  TORCH_CHECK(value_cache.data_ptr() != key_cache.data_ptr() ||
                  value_cache.sizes() != key_cache.sizes() ||
                  (key_scale ? key_scale->data_ptr() : nullptr) ==
                      (value_scale ? value_scale->data_ptr() : nullptr),
              kOp, ": a value inside its key (one cache passed twice) takes the key's scales");
  return format;
}

}  // namespace kvserve::ops
