#pragma once
// gpt-oss's gate: a SwiGLU whose gate and up inputs are clamped, with a sharper sigmoid.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// Per element i < d, in fp32: g = min(gate, limit), u = clamp(up, -limit, limit);
/// out = (u + 1) * g * sigmoid(alpha * g), with gate = input[:, i], up = input[:, d + i].
/// input: [num_tokens, 2 * d] (gate then up); out: [num_tokens, d]; one dtype; rows may be
/// strided, the last dim contiguous. alpha > 0 and limit > 0 (gpt-oss: 1.702 and 7).
void clamped_swiglu_and_mul(at::Tensor& out, const at::Tensor& input, double alpha,
                            double limit);

}  // namespace kvserve::ops
