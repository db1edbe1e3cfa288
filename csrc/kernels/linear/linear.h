#pragma once
// Dense projection y = x W^T + b over flattened tokens, on a plain or a packed weight.

#include <ATen/core/Tensor.h>
#include <optional>

namespace kvserve::ops {

/// Returns out [num_tokens, out_features] = input [num_tokens, in_features] (rows may be strided,
/// last dim contiguous) @ weight^T + bias, in the input dtype with fp32 accumulation.
/// weight: contiguous [out_features, in_features], or that weight packed by linear_prepack;
/// bias: [out_features] or none; one dtype. A few tokens (decode) run a GEMV kernel that streams
/// the weight once at memory bandwidth (it reads the packed layout too); more tokens go to a
/// GEMM: oneDNN's on a packed weight, else the BLAS of the build (MKL / oneDNN / cuBLAS), which
/// repacks the weight on every call. Throws c10::Error on mismatched shapes or dtypes, or a
/// packed weight that linear_prepack did not make.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias);

/// The weight [out_features, in_features] in the blocked layout the device's GEMM reads without
/// repacking (oneDNN's, for fp32 and bf16 on CPU), when kvserve's GEMV can read that layout too
/// (checked element by element against `weight`). Then the packed weight replaces the plain one:
/// one copy serves both. Otherwise an undefined tensor: keep the plain weight.
at::Tensor linear_prepack(const at::Tensor& weight);

/// Rows `ids` (int64 [T]) of a plain or packed weight: [T, in_features] in its dtype. A tied
/// embedding reads the LM head's packed weight this way instead of keeping a plain copy.
at::Tensor linear_gather_rows(const at::Tensor& weight, const at::Tensor& ids);

/// Bytes a plain or packed weight occupies (a packed one pads its blocks).
int64_t linear_weight_nbytes(const at::Tensor& weight);

}  // namespace kvserve::ops
