#pragma once
// Argument checks of paged_attention shared by its CPU and CUDA launchers: shapes, dtypes and
// devices. The metadata's values are checked on the host by the CPU launcher alone.

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace paged_attention_checks {

constexpr const char* kOp = "paged_attention";

void check_heads(const char* name, const at::Tensor& t);

}  // namespace paged_attention_checks

/// Checks every argument but the metadata's values; returns the caches' format.
cpu::KVCacheFormat check_paged_attention(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, const std::optional<at::Tensor>& key_scale,
    const std::optional<at::Tensor>& value_scale);

}  // namespace kvserve::ops
