#pragma once
// The SwiGLU gate of Llama-family MLPs.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// out = silu(input[:, :d]) * input[:, d:], computed in fp32.
/// input: [num_tokens, 2 * d] (the fused gate_up projection); out: [num_tokens, d]; one dtype.
void silu_and_mul(at::Tensor& out, const at::Tensor& input);

}  // namespace kvserve::ops
