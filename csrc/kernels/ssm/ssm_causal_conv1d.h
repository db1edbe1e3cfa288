#pragma once
// Mamba's short causal convolution over the tokens of several sequences, each sequence carrying
// its last kernel - 1 inputs in a slot of a state pool from one call (prefill chunk or decode
// token) to the next.

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// Per channel c of each sequence s (tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1 of input):
/// out[t, c] = act(bias[c] + sum_j weight[c, j] * h[t + j]), h being the sequence's previous
/// kernel - 1 inputs of the channel (conv_state[slots[s], c, :], oldest first, or zeros when
/// has_initial_state[s] is false) followed by its tokens; act is SiLU when `silu`. Afterwards
/// conv_state[slots[s]] holds the last kernel - 1 values of h. A sequence of no tokens leaves
/// its slot as it was (when it has an initial state) or zeroes it.
/// out, input: [num_tokens, dim], last dim contiguous, one dtype (fp32, bf16, fp16); weight:
/// contiguous [dim, kernel], 2 <= kernel <= 16, input's dtype or fp32; bias: [dim] like weight;
/// conv_state: contiguous [num_slots, dim, kernel - 1], fp32 or input's dtype; cu_seqlens: int32
/// [num_seqs + 1], non-decreasing from 0 to num_tokens; slots: int32 [num_seqs], distinct, in
/// [0, num_slots); has_initial_state: bool [num_seqs]. The int and bool tensors are on the
/// input's device. Throws c10::Error on shapes, dtypes or devices that differ; the CPU launcher
/// also on cu_seqlens or slots out of range (the CUDA kernel skips such sequences).
void ssm_causal_conv1d(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::Tensor& conv_state,
                       const at::Tensor& cu_seqlens, const at::Tensor& slots,
                       const at::Tensor& has_initial_state, bool silu);

}  // namespace kvserve::ops
