#pragma once
// Argument checks of rejection_sample shared by its CPU and CUDA launchers: the tensors' shapes,
// dtypes and devices, and cu_num_drafts' values wherever the host holds them.

#include <ATen/core/Tensor.h>

#include <algorithm>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Shapes, dtypes and devices (see rejection_sampling.h); cu_num_drafts may be on any device.
void check_rejection_sample(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                            const at::Tensor& draft_token_ids,
                            const at::Tensor& cu_num_drafts, const at::Tensor& uniform);

/// cu_num_drafts' values, in host memory ([batch + 1]): from 0 to num_drafts, non-decreasing.
/// Returns the most drafts of one sequence.
int64_t check_cu_num_drafts(const int64_t* cu, int64_t batch, int64_t num_drafts);

}  // namespace kvserve::ops
