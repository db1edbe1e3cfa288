#pragma once
// LLM.int8() (Dettmers et al. 2022): a projection on an int8 weight whose activations are split by
// magnitude. Outlier activations run in floating point against the matching weight columns; the
// rest are rounded to int8 per token and multiplied in integers.

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// Returns out [num_tokens, n] = input [num_tokens, k] @ W^T + bias, in the input dtype (fp32,
/// bf16 or fp16), where W = weight (int8 [n, k]) * weight_scales (fp32 [n], one per output row)
/// and the product is LLM.int8()'s decomposition:
///
///   C_t = { j : |input[t, j]| >= threshold }                          (token t's outliers)
///   s_t = max_{j not in C_t} |input[t, j]| / 127,
///   x_q[t, j] = round_half_even(input[t, j] / s_t) for j not in C_t (0 in C_t; s_t = 0 and
///         x_q = 0 for a row without inliers; s_t = NaN for inliers holding a NaN or an
///         infinity, which makes the token's outputs NaN)
///   out[t, o] = s_t * weight_scales[o] * sum_{j not in C_t} x_q[t, j] * weight[o, j]  (int32)
///             + sum_{j in C_t} input[t, j] * weight[o, j] * weight_scales[o]           (fp32)
///             + bias[o]
///
/// threshold <= 0 (or inf) leaves C_t empty: W8A8 with dynamic per-token scales. bitsandbytes
/// takes whole columns as outliers, over all the tokens of a call; here each token decides for
/// its own entries, so that a token's result does not depend on which requests share its batch
/// (a column that is an outlier in every token is the same either way). input rows may be
/// strided (last dim contiguous); bias [n] of the input dtype or absent. Throws on other shapes
/// or dtypes.
at::Tensor llm_int8_linear(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& weight_scales, double threshold,
                           const std::optional<at::Tensor>& bias = std::nullopt);

}  // namespace kvserve::ops
