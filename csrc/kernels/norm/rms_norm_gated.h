#pragma once
// Mamba2's gated RMSNorm: the gate applied first, then an RMSNorm over groups of channels.

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// h = input * silu(gate) (input alone without a gate), in fp32; per group of group_size
/// channels, n = h * rsqrt(mean(h^2) + epsilon), rounded to the dtype; out = n * weight.
/// out, input, gate: [num_tokens, dim], last dim contiguous, one dtype; weight: contiguous
/// [dim], input's dtype or fp32; group_size >= 1 divides dim. Throws c10::Error otherwise.
void rms_norm_gated(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& gate,
                    const at::Tensor& weight, int64_t group_size, double epsilon);

}  // namespace kvserve::ops
