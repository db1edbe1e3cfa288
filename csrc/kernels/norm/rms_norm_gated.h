#pragma once
// The gated output of a state-space mixer: Mamba2's gated RMSNorm (the gate first, then an
// RMSNorm over groups of channels), FalconH1's norm-then-gate order, or the gate alone.

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// Per row, over groups of group_size channels, in fp32:
/// - weight given, norm_before_gate false (Mamba2): h = input * silu(gate) (input alone without
///   a gate); n = h * rsqrt(mean(h^2) + epsilon), rounded to the dtype; out = n * weight.
/// - weight given, norm_before_gate true (FalconH1): n = input * rsqrt(mean(input^2) +
///   epsilon); out = n * weight * silu(gate) (n * weight without a gate), rounded once.
/// - weight absent (FalconH1 without its mixer norm): out = input * silu(gate), rounded once;
///   gate required, epsilon unused.
/// out, input, gate: [num_tokens, dim], last dim contiguous, one dtype; weight: contiguous
/// [dim], input's dtype or fp32; group_size >= 1 divides dim. Throws c10::Error otherwise.
void rms_norm_gated(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& gate,
                    const std::optional<at::Tensor>& weight, int64_t group_size, double epsilon,
                    bool norm_before_gate = false);

}  // namespace kvserve::ops
