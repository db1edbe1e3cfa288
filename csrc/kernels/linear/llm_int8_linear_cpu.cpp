// CPU launcher for llm_int8_linear: checks, the outliers (ATen), the per-token int8 rounding of
// the rest with the integer product and its scales (int8_linear_stub, per CPU capability), then
// the outlier columns' fp32 product and the bias.
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/linear/llm_int8_linear.h"
#include "kernels/linear/llm_int8_linear_checks.h"

namespace kvserve::ops {
namespace {

at::Tensor llm_int8_linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                               const at::Tensor& weight_scales, double threshold,
                               const std::optional<at::Tensor>& bias) {
  check_llm_int8_linear(input, weight, weight_scales, threshold, bias);
  const at::ScalarType dtype = input.scalar_type();
  const int64_t m = input.size(0), n = weight.size(0), k = weight.size(1);
  if (m == 0) return at::empty({0, n}, input.options());

  const at::Tensor x = input.to(at::kFloat).contiguous();
  at::Tensor inliers = x, mask, outliers;
  if (threshold > 0) {
    mask = x.abs() >= threshold;
    outliers = mask.any(0).nonzero().squeeze(1);  // columns with an outlier in some token
    if (outliers.numel() > 0) inliers = x.masked_fill(mask, 0.0);
  }
  at::Tensor out = at::empty({m, n}, x.options());
  cpu::int8_linear_stub.get()(inliers.data_ptr<float>(), m, k, weight.data_ptr<int8_t>(), n,
                              weight_scales.data_ptr<float>(), out.data_ptr<float>());
  if (outliers.defined() && outliers.numel() > 0) {
    // Each token adds x[t, j] times weight column j for its own outliers j, in ascending j: the
    // same operations whatever else is in the batch (a GEMM over the batch's columns would
    // block its sums by the batch's shape).
    const at::Tensor columns = weight.index_select(1, outliers).t().to(at::kFloat)
                                   .mul_(weight_scales.unsqueeze(0)).contiguous();  // [c, n]
    const int64_t c = outliers.numel();
    const float* col = columns.data_ptr<float>();
    const int64_t* ids = outliers.data_ptr<int64_t>();
    const bool* is_outlier = mask.data_ptr<bool>();
    const float* xs = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < c; ++i) {
          if (!is_outlier[t * k + ids[i]]) continue;
          const float v = xs[t * k + ids[i]];
          for (int64_t j = 0; j < n; ++j) o[t * n + j] += v * col[i * n + j];
        }
      }
    });
  }
  if (bias) out.add_(bias->to(at::kFloat));
  return out.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("llm_int8_linear", &llm_int8_linear_cpu); }

}  // namespace kvserve::ops
