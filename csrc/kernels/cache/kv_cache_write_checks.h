#pragma once
// Argument checks of kv_cache_write shared by its CPU and CUDA launchers (shapes, dtypes,
// devices; the slots' range is checked on the host by the CPU launcher alone).

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace kv_cache_write_checks {

constexpr const char* kOp = "kv_cache_write";

void check_token_rows(const char* name, const at::Tensor& t, const at::Tensor& cache);

}  // namespace kv_cache_write_checks

/// Checks every argument but the slots' values; returns the caches' format.
cpu::KVCacheFormat check_kv_cache_write(const at::Tensor& key, const at::Tensor& value,
                                        const at::Tensor& key_cache,
                                        const at::Tensor& value_cache,
                                        const at::Tensor& slot_mapping,
                                        const std::optional<at::Tensor>& key_scale,
                                        const std::optional<at::Tensor>& value_scale);

}  // namespace kvserve::ops
