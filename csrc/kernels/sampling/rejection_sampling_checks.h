#pragma once
// Argument checks of rejection_sample shared by its CPU and CUDA launchers: the tensors' shapes,
// dtypes and devices, and cu_num_drafts' values wherever the host holds them.

#include <ATen/core/Tensor.h>

#include <algorithm>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Shapes, dtypes and devices (see rejection_sampling.h); cu_num_drafts may be on any device.
inline void check_rejection_sample(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                   const at::Tensor& draft_token_ids,
                                   const at::Tensor& cu_num_drafts, const at::Tensor& uniform) {
  constexpr const char* op = "rejection_sample";
  check_rows(op, "target_probs", target_probs, 2);
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat, op, ": target_probs must be float32");
  check_contiguous(op, "draft_token_ids", draft_token_ids, at::kLong);
  check_contiguous(op, "cu_num_drafts", cu_num_drafts, at::kLong);
  check_contiguous(op, "uniform", uniform, at::kFloat);
  TORCH_CHECK(draft_token_ids.dim() == 1 && cu_num_drafts.dim() == 1 && uniform.dim() == 1, op,
              ": draft_token_ids, cu_num_drafts and uniform must be 1-d");
  const int64_t batch = cu_num_drafts.numel() - 1;
  TORCH_CHECK(batch >= 0, op, ": cu_num_drafts needs B + 1 entries");
  const int64_t num_drafts = draft_token_ids.numel();
  const int64_t vocab = target_probs.size(1);
  TORCH_CHECK(vocab > 0, op, ": empty vocabulary");
  TORCH_CHECK(target_probs.size(0) == num_drafts + batch, op, ": target_probs needs ",
              num_drafts + batch, " rows (one per draft and one bonus row per sequence), got ",
              target_probs.size(0));
  TORCH_CHECK(uniform.numel() == num_drafts + batch, op, ": uniform needs one entry per "
              "target row (", num_drafts + batch, ")");
  const bool point_mass = draft_probs.numel() == 0;
  if (!point_mass) {
    check_rows(op, "draft_probs", draft_probs, 2);
    TORCH_CHECK(draft_probs.scalar_type() == at::kFloat, op, ": draft_probs must be float32");
    TORCH_CHECK(draft_probs.size(0) == num_drafts && draft_probs.size(1) == vocab, op,
                ": draft_probs must be [", num_drafts, ", ", vocab, "], got ", draft_probs.sizes());
  }
  const at::Device device = target_probs.device();
  TORCH_CHECK((point_mass || draft_probs.device() == device) &&
                  draft_token_ids.device() == device && uniform.device() == device,
              op, ": draft_probs, draft_token_ids and uniform must be on target_probs' device ",
              device);
}

/// cu_num_drafts' values, in host memory ([batch + 1]): from 0 to num_drafts, non-decreasing.
/// Returns the most drafts of one sequence.
inline int64_t check_cu_num_drafts(const int64_t* cu, int64_t batch, int64_t num_drafts) {
  constexpr const char* op = "rejection_sample";
  TORCH_CHECK(cu[0] == 0 && cu[batch] == num_drafts, op, ": cu_num_drafts must run from 0 to ",
              num_drafts, " (the number of draft tokens)");
  int64_t max_k = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(cu[b + 1] >= cu[b], op, ": cu_num_drafts must be non-decreasing");
    max_k = std::max(max_k, cu[b + 1] - cu[b]);
  }
  return max_k;
}

}  // namespace kvserve::ops
