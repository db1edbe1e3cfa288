// CPU launcher for llm_int8_linear: checks, the outliers and the per-token int8 rounding of the
// rest (ATen, vectorized), the integer product (int8_gemm_stub, per CPU capability), then
// scales, the outlier columns' fp32 product and the bias.
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/round.h>
#include <ATen/ops/where.h>
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
  const at::Tensor scale = inliers.abs().amax(1) / 127.0f;  // [m]
  const at::Tensor safe = at::where(scale > 0, scale, at::ones_like(scale));
  const at::Tensor xq = at::round(inliers / safe.unsqueeze(1)).clamp_(-127, 127).to(at::kShort);
  at::Tensor acc = at::empty({m, n}, x.options().dtype(at::kInt));
  cpu::int8_gemm_stub.get()(xq.data_ptr<int16_t>(), m, weight.data_ptr<int8_t>(), n, k,
                            acc.data_ptr<int32_t>());
  at::Tensor out = acc.to(at::kFloat).mul_(scale.unsqueeze(1)).mul_(weight_scales.unsqueeze(0));
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
