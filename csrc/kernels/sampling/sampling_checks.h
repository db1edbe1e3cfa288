#pragma once
// Argument checks of sampling_filter_logits and sampling_from_logits (contract: sampling.h),
// shared by their CPU and CUDA launchers.

#include <ATen/core/Tensor.h>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Checks a per-row argument: contiguous, of `dtype`, one entry per row of logits, on its device.
inline void check_sampling_per_row(const char* op, const char* name, const at::Tensor& t,
                                   at::ScalarType dtype, const at::Tensor& logits) {
  check_contiguous(op, name, t, dtype);
  TORCH_CHECK(t.numel() == logits.size(0), op, ": ", name, " must have one entry per row (",
              logits.size(0), ")");
  TORCH_CHECK(t.device() == logits.device(), op, ": ", name, " is on ", t.device(),
              ", logits on ", logits.device());
}

/// Checks logits: fp32 [num_rows, vocab], contiguous in its last dimension.
inline void check_sampling_logits(const char* op, const at::Tensor& logits) {
  check_rows(op, "logits", logits, 2);
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32");
}

/// The arguments of sampling_filter_logits: logits as above; temperature, top_p, min_p fp32 and
/// top_k int64, each contiguous [num_rows] on the logits' device.
inline void check_sampling_filter_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                         const at::Tensor& top_k, const at::Tensor& top_p,
                                         const at::Tensor& min_p) {
  constexpr const char* op = "sampling_filter_logits";
  check_sampling_logits(op, logits);
  check_sampling_per_row(op, "temperature", temperature, at::kFloat, logits);
  check_sampling_per_row(op, "top_k", top_k, at::kLong, logits);
  check_sampling_per_row(op, "top_p", top_p, at::kFloat, logits);
  check_sampling_per_row(op, "min_p", min_p, at::kFloat, logits);
}

/// The arguments of sampling_from_logits: logits as above with a vocabulary of at least one
/// token; temperature and uniform fp32, each contiguous [num_rows] on the logits' device.
inline void check_sampling_from_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                       const at::Tensor& uniform) {
  constexpr const char* op = "sampling_from_logits";
  check_sampling_logits(op, logits);
  TORCH_CHECK(logits.size(1) > 0, op, ": empty vocabulary");
  check_sampling_per_row(op, "temperature", temperature, at::kFloat, logits);
  check_sampling_per_row(op, "uniform", uniform, at::kFloat, logits);
}

}  // namespace kvserve::ops
