// CPU launchers for the sampling ops.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"
#include "kernels/sampling/sampling.h"

namespace kvserve::ops {
namespace {

void check_per_row(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                   int64_t rows) {
  check_contiguous(op, name, t, dtype);
  TORCH_CHECK(t.numel() == rows, op, ": ", name, " must have one entry per row (", rows, ")");
}

void sampling_filter_logits_cpu(at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& top_k, const at::Tensor& top_p,
                                const at::Tensor& min_p) {
  constexpr const char* op = "sampling_filter_logits";
  check_rows(op, "logits", logits, 2);
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32");
  const int64_t rows = logits.size(0);
  check_per_row(op, "temperature", temperature, at::kFloat, rows);
  check_per_row(op, "top_k", top_k, at::kLong, rows);
  check_per_row(op, "top_p", top_p, at::kFloat, rows);
  check_per_row(op, "min_p", min_p, at::kFloat, rows);
  cpu::sampling_filter_stub.get()(logits.data_ptr<float>(), logits.stride(0), rows, logits.size(1),
                                  temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(),
                                  top_p.data_ptr<float>(), min_p.data_ptr<float>());
}

at::Tensor sampling_from_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature,
                                    const at::Tensor& uniform) {
  constexpr const char* op = "sampling_from_logits";
  check_rows(op, "logits", logits, 2);
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32");
  TORCH_CHECK(logits.size(1) > 0, op, ": empty vocabulary");
  const int64_t rows = logits.size(0);
  check_per_row(op, "temperature", temperature, at::kFloat, rows);
  check_per_row(op, "uniform", uniform, at::kFloat, rows);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  cpu::sampling_sample_stub.get()(logits.data_ptr<float>(), logits.stride(0), rows, logits.size(1),
                                  temperature.data_ptr<float>(), uniform.data_ptr<float>(),
                                  out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("sampling_filter_logits", &sampling_filter_logits_cpu);
  m.impl("sampling_from_logits", &sampling_from_logits_cpu);
}

}  // namespace kvserve::ops
