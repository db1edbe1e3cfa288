// Compiled by the C++ compiler only, so that a failing check formats its message with the
// C++ runtime the rest of the library uses (see sampling_checks.h).
#include "kernels/sampling/sampling_checks.h"

namespace kvserve::ops {
void check_sampling_per_row(const char* op, const char* name, const at::Tensor& t,
                            at::ScalarType dtype, const at::Tensor& logits) {
  check_contiguous(op, name, t, dtype);
  TORCH_CHECK(t.numel() == logits.size(0), op, ": ", name, " must have one entry per row (",
              logits.size(0), ")");
  TORCH_CHECK(t.device() == logits.device(), op, ": ", name, " is on ", t.device(),
              ", logits on ", logits.device());
}

void check_sampling_logits(const char* op, const at::Tensor& logits) {
  check_rows(op, "logits", logits, 2);
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32");
}

void check_sampling_filter_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                  const at::Tensor& top_k, const at::Tensor& top_p,
                                  const at::Tensor& min_p) {
  constexpr const char* op = "sampling_filter_logits";
  check_sampling_logits(op, logits);
  check_sampling_per_row(op, "temperature", temperature, at::kFloat, logits);
  check_sampling_per_row(op, "top_k", top_k, at::kLong, logits);
  check_sampling_per_row(op, "top_p", top_p, at::kFloat, logits);
  check_sampling_per_row(op, "min_p", min_p, at::kFloat, logits);
}

void check_sampling_from_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& uniform) {
  constexpr const char* op = "sampling_from_logits";
  check_sampling_logits(op, logits);
  TORCH_CHECK(logits.size(1) > 0, op, ": empty vocabulary");
  check_sampling_per_row(op, "temperature", temperature, at::kFloat, logits);
  check_sampling_per_row(op, "uniform", uniform, at::kFloat, logits);
}

}  // namespace kvserve::ops
