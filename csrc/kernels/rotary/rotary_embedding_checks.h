#pragma once
// Argument checks of rotary_embedding shared by its CPU and CUDA launchers (shapes and dtypes
// only: the positions' range is checked on the host by the CPU launcher alone).

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

inline void check_head_norm(const char* name, const std::optional<at::Tensor>& weight,
                            const at::Tensor& query, int64_t head_dim) {
  if (!weight) return;
  const at::Tensor& w = *weight;
  TORCH_CHECK(w.scalar_type() == query.scalar_type() || w.scalar_type() == at::kFloat,
              "rotary_embedding: ", name, " must have the query's dtype ", query.scalar_type(),
              " or be float32, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == head_dim && w.is_contiguous(), "rotary_embedding: ",
              name, " must be contiguous [", head_dim, "], got ", w.sizes());
  TORCH_CHECK(w.device() == query.device(), "rotary_embedding: ", name, " is on ", w.device(),
              ", expected ", query.device());
}

/// The norm weights' element type (contract: rotary_embedding.h); Undefined without norms.
inline at::ScalarType check_head_norms(const at::Tensor& query, int64_t head_dim,
                                       const std::optional<at::Tensor>& query_norm,
                                       const std::optional<at::Tensor>& key_norm,
                                       double norm_epsilon) {
  check_head_norm("query_norm", query_norm, query, head_dim);
  check_head_norm("key_norm", key_norm, query, head_dim);
  TORCH_CHECK(!query_norm || !key_norm || query_norm->scalar_type() == key_norm->scalar_type(),
              "rotary_embedding: query_norm and key_norm must have one dtype");
  TORCH_CHECK(norm_epsilon >= 0.0, "rotary_embedding: norm_epsilon must be >= 0, got ",
              norm_epsilon);
  return query_norm ? query_norm->scalar_type()
                    : key_norm ? key_norm->scalar_type() : at::ScalarType::Undefined;
}

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
