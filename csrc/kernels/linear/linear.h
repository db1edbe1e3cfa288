#pragma once
// Dense projection y = x W^T + b over flattened tokens.

#include <ATen/core/Tensor.h>
#include <optional>

namespace kvserve::ops {

/// Returns out [num_tokens, out_features] = input [num_tokens, in_features] (rows may be strided,
/// last dim contiguous) @ weight^T + bias, in the input dtype with fp32 accumulation.
/// weight: contiguous [out_features, in_features]; bias: [out_features] or none; one dtype.
/// A few tokens (decode) run a GEMV kernel that streams the weight once at memory bandwidth;
/// more tokens (prefill) go to the BLAS GEMM of the build (MKL / oneDNN / cuBLAS).
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias);

}  // namespace kvserve::ops
