#pragma once
// RMSNorm ops (Llama, Qwen, Mistral): fp32 accumulation, output in the input dtype.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// out = input * rsqrt(mean(input^2) + epsilon) * weight, row by row.
/// out, input: [num_tokens, hidden], last dim contiguous, one dtype; weight: [hidden], of that
/// dtype or fp32 (then applied in fp32 before the one rounding to the dtype, as Gemma's (1 + w)).
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon);

/// In place: residual += input (rounded to the dtype), then input = rms_norm(residual) * weight.
/// input, residual: [num_tokens, hidden], last dim contiguous; weight: [hidden] as rms_norm's.
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon);

}  // namespace kvserve::ops
