#pragma once
// Dense projection y = x W^T + b over flattened tokens.

#include <ATen/core/Tensor.h>
#include <optional>

namespace kvserve::ops {

/// Returns out [num_tokens, out_features] = input [num_tokens, in_features] (rows may be strided,
/// last dim contiguous) @ weight^T + bias, in the input dtype with fp32 accumulation.
/// weight: contiguous [out_features, in_features]; bias: [out_features] or none; one dtype.
/// packed_weight: the same weight from linear_prepack, or none.
/// A few tokens (decode) run a GEMV kernel that streams the weight once at memory bandwidth;
/// more tokens go to a GEMM: on the packed weight when there is one, else the BLAS of the build
/// (MKL / oneDNN / cuBLAS).
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& packed_weight = std::nullopt);

/// The weight [out_features, in_features] in the blocked layout that the device's GEMM reads
/// without repacking it on every call (oneDNN's, for fp32 and bf16 on CPU), or an undefined
/// tensor where there is none. The result is only for linear's packed_weight.
at::Tensor linear_prepack(const at::Tensor& weight);

}  // namespace kvserve::ops
