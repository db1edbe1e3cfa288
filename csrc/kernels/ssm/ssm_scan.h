#pragma once
// The selective state-space scan over the tokens of several sequences, each reading and writing
// its state in a slot of a state pool: a prefill chunk or a decode token per sequence in one
// call. Mamba2's (SSD: a decay rate a head) and Mamba's (S6: a decay rate per channel and state
// entry, each channel a head of one). The CPU body runs the recurrent form; the CUDA body the
// recurrent form for decode batches and, for Mamba2, the chunked form for batches with prefill
// (ssm_chunk_scan_kernel.cuh).

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvserve::ops {

/// Per sequence s (tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1), head h and token t, with
/// d = clamp(softplus(dt[t, h] + dt_bias[h]), dt_min, dt_max) (softplus when dt_softplus),
/// g = h / (heads / groups) the head's group and S = state[slots[s], h] ([head_dim, state_size],
/// zeros when has_initial_state[s] is false):
///   S = exp(d * A[h]) * S + d * x[t, h] B[t, g]^T;   out[t, h] = S C[t, g] + D[h] * x[t, h],
/// where A [heads, state_size] (Mamba) scales each column n of S by exp(d * A[h, n]).
/// Afterwards state[slots[s]] holds the final S (computed in fp32). A sequence of no tokens
/// leaves its slot as it was or zeroes it (without an initial state).
/// out, x: [num_tokens, heads, head_dim]; dt: [num_tokens, heads]; B, C: [num_tokens, groups,
/// state_size], heads a multiple of groups; one dtype (fp32, bf16, fp16), any token stride,
/// the other dimensions contiguous. A: fp32 [heads] or [heads, state_size], contiguous;
/// D, dt_bias: [heads], fp32 or x's dtype.
/// state: contiguous [num_slots, heads, head_dim, state_size], fp32 or x's dtype. cu_seqlens,
/// slots, has_initial_state as ssm_causal_conv1d's. Throws c10::Error as ssm_causal_conv1d.
void ssm_scan(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
              const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
              const std::optional<at::Tensor>& dt_bias, at::Tensor& state,
              const at::Tensor& cu_seqlens, const at::Tensor& slots,
              const at::Tensor& has_initial_state, bool dt_softplus, double dt_min,
              double dt_max);

}  // namespace kvserve::ops
