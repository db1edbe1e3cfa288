#pragma once
// LayerNorm op (Cohere's norms, which have no bias; GPT-style norms with one): the row's mean
// and variance in fp32, output in the input dtype.

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// Row by row, in fp32: mean = sum(x) / hidden, var = sum((x - mean)^2) / hidden (two passes,
/// as torch and transformers compute it), out = (x - mean) * rsqrt(var + epsilon) * weight
/// (+ bias), rounded once to the dtype.
/// out, input: [num_tokens, hidden], last dim contiguous, one dtype; weight, bias: contiguous
/// [hidden], of input's dtype or fp32. Throws c10::Error otherwise.
void layer_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, double epsilon);

}  // namespace kvserve::ops
