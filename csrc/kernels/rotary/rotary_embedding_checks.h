#pragma once
// Argument checks of rotary_embedding shared by its CPU and CUDA launchers (shapes and dtypes
// only: the positions' range is checked on the host by the CPU launcher alone).

#include <ATen/core/Tensor.h>

#include "kernels/op_checks.h"

namespace kvserve::ops {

inline void check_rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                   const at::Tensor& key, int64_t head_dim,
                                   const at::Tensor& cos_sin_cache) {
  constexpr const char* op = "rotary_embedding";
  check_contiguous(op, "positions", positions, at::kLong);
  check_contiguous(op, "cos_sin_cache", cos_sin_cache, at::kFloat);
  check_rows(op, "query", query, 2);
  check_rows(op, "key", key, 2);
  check_like(op, "key", key, query);
  const int64_t num_tokens = positions.numel();
  TORCH_CHECK(query.size(0) == num_tokens && key.size(0) == num_tokens, op,
              ": query and key need one row per position");
  TORCH_CHECK(head_dim > 0 && query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0, op,
              ": row widths must be multiples of head_dim ", head_dim);
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) % 2 == 0 &&
                  cos_sin_cache.size(1) <= head_dim,
              op, ": cos_sin_cache must be [max_position, rot_dim] with even rot_dim <= head_dim");
  TORCH_CHECK(positions.device() == query.device() && cos_sin_cache.device() == query.device(),
              op, ": positions and cos_sin_cache must be on the query's device");
}

}  // namespace kvserve::ops
