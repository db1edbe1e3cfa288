#pragma once
// The GeGLU gate of Gemma MLPs (hidden_act gelu_pytorch_tanh).

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// out = gelu_tanh(input[:, :d]) * input[:, d:], computed in fp32, where
/// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (PyTorch's approximate="tanh").
/// input: [num_tokens, 2 * d] (the fused gate_up projection); out: [num_tokens, d]; one dtype.
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input);

}  // namespace kvserve::ops
