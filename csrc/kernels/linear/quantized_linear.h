#pragma once
// Projection y = x dequant(W)^T + b on a weight-only quantized weight (int8, int4, fp8 E4M3).

#include <ATen/core/Tensor.h>
#include <optional>

namespace kvserve::ops {

/// Returns out [num_tokens, n] = input [num_tokens, k] (rows may be strided, last dim contiguous)
/// @ dequant(qweight)^T + bias, in the input dtype (fp32, bf16 or fp16) with fp32 accumulation,
/// where, with g = group_size (which divides k; g = k is one group per output row):
///
///   dequant(qweight)[o, i] = (q[o, i] - zeros[o, i / g]) * scales[o, i / g]
///
/// and q[o, i] is, by the dtype of qweight:
///   - int8 [n, k]: the int8 value (-128..127);
///   - uint8 [n, k / 2]: an unsigned int4 (0..15). Inputs come in chunks of 32; byte j (0..15)
///     of a chunk holds input j in its low nibble and input j + 16 in its high nibble (the
///     order of llama.cpp's Q4_0, so that a 16-byte load unpacks to 32 inputs in order).
///     k and g must be multiples of 32;
///   - float8_e4m3fn [n, k]: the E4M3 number (no infinities; 0x7f / 0xff are NaN).
/// scales: fp32 or fp16 [n, k / g]; zeros: [n, k / g] in the scales' dtype, a single one [1]
/// for every row and group (symmetric formats: llama.cpp's Q4_0 and GPTQ's sym=True store 8 for
/// int4), or none (0); fp16 ones (AWQ's, GPTQ's and GGUF's as stored) are read as they are and
/// widened in registers. (On CUDA a single zero is expanded to [n, k / g] for the call.)
/// bias: [n] in the input dtype.
///
/// Two-level scales (llama.cpp's K-quants, whose groups' scales are small integers under a
/// factor per super-block of 256 inputs): with super_scales, scales are int8 [n, k / g] and
/// super_scales fp32 or fp16 [n, supers] (supers dividing k / g; S = (k / g) / supers groups a
/// super-block), and zeros, where given, are int8 [n, k / g] with super_mins as super_scales:
///
///   dequant(qweight)[o, i] = q[o, i] * super_scales[o, j / S] * scales[o, j]
///                            - super_mins[o, j / S] * zeros[o, j]          (j = i / g)
///
/// which, unlike the one-level form, holds a group whose scale is 0 and whose minimum is not.
/// The CPU runs it; CUDA refuses it (a loader expands such weights for CUDA:
/// kvserve.quantization.weights.QuantizedWeight.one_level).
///
/// quantize_input (int8 and int4 weights only) rounds the input to int8 first and computes the
/// same formula on the rounded input: per token, each group is cut into blocks of 32 inputs from
/// its start (the last one shorter when g is not a multiple of 32), and a block with
/// a = max |x| becomes x'[i] = d * q[i], d = a / 127, q[i] = round_half_even(x[i] * (127 / a))
/// (q = 0 when a = 0), each step in fp32; a block holding a NaN or an infinity makes every output
/// that reads it NaN. On the CPU, up to 32 tokens multiply the weight's q by q in integers
/// (llama.cpp's Q8_0 activations); more tokens, and CUDA, run the paths below on x'.
///
/// Without it, a few tokens (decode) run a GEMV that streams the packed weight once and dequantizes in
/// registers; on CUDA, bf16 / fp16 inputs of 2-64 tokens run tensor cores on the packed weight,
/// dequantized in registers too; more tokens dequantize blocks of rows and run the device's GEMM
/// on them (quantized_linear_kernel_choice.h picks a CUDA body by name). Throws
/// c10::Error naming the argument for any shape, dtype or group size outside this contract.
at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& qweight,
                            const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                            int64_t group_size, const std::optional<at::Tensor>& bias,
                            bool quantize_input = false,
                            const std::optional<at::Tensor>& super_scales = std::nullopt,
                            const std::optional<at::Tensor>& super_mins = std::nullopt);

/// x' of quantize_input above, fp32 [T, k], for input [T, k] (any float dtype, any device): the
/// rounding the CPU's integer kernels take, for the paths that multiply in floating point.
at::Tensor round_input_to_int8_blocks(const at::Tensor& input, int64_t group_size);

}  // namespace kvserve::ops
