#pragma once
// RMSNorm ops (Llama, Qwen, Mistral): fp32 accumulation, output in the input dtype.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// out = input * rsqrt(mean(input^2) + epsilon) * weight, row by row.
/// out, input: [num_tokens, hidden], last dim contiguous; weight: [hidden]; one dtype.
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon);

/// In place: residual += input (rounded to the dtype), then input = rms_norm(residual) * weight.
/// input, residual: [num_tokens, hidden], last dim contiguous; weight: [hidden].
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon);

}  // namespace kvserve::ops
