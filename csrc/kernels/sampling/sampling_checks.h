#pragma once
// Argument checks of sampling_filter_logits and sampling_from_logits (contract: sampling.h),
// shared by their CPU and CUDA launchers.

#include <ATen/core/Tensor.h>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Checks a per-row argument: contiguous, of `dtype`, one entry per row of logits, on its device.
void check_sampling_per_row(const char* op, const char* name, const at::Tensor& t,
                            at::ScalarType dtype, const at::Tensor& logits);

/// Checks logits: fp32 [num_rows, vocab], contiguous in its last dimension.
void check_sampling_logits(const char* op, const at::Tensor& logits);

/// The arguments of sampling_filter_logits: logits as above; temperature, top_p, min_p fp32 and
/// top_k int64, each contiguous [num_rows] on the logits' device.
void check_sampling_filter_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                  const at::Tensor& top_k, const at::Tensor& top_p,
                                  const at::Tensor& min_p);

/// The arguments of sampling_from_logits: logits as above with a vocabulary of at least one
/// token; temperature and uniform fp32, each contiguous [num_rows] on the logits' device.
void check_sampling_from_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& uniform);

}  // namespace kvserve::ops
