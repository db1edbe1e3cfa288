#pragma once
// CUDA body of ssm_scan (contract: ssm_scan.h) in the chunked form of SSD (Dao & Gu, 2024,
// "Transformers are SSMs", section 6): a sequence's tokens in chunks of kSsdChunk, each chunk
// computed from the state at its start by products the block's threads share instead of one
// token after another. With a_u = d_u A the log-decay of token u and cum_t = a_1 + ... + a_t
// within the chunk, for the chunk's tokens t and the state S at its start:
//   y_t = exp(cum_t) S C_t + sum_{u <= t} exp(cum_t - cum_u) d_u (C_t . B_u) x_u + D x_t
//   S  <- exp(cum_L) S + sum_u exp(cum_L - cum_u) d_u x_u B_u^T
// which is the recurrent form (ssm_scan_kernel.cuh) summed over the chunk, every exponent <= 0.
// One block per (sequence, head) keeps S in fp32 shared memory across its chunks, with the
// chunk's x, B, C and the masked decay matrix M[t, u] = exp(cum_t - cum_u) d_u (C_t . B_u).
// Rows of S, B and C are padded by one float so that threads walking a column hit distinct
// banks. A sequence shorter than a chunk (a decode token) is one partial chunk. CUDA cores only
// (no tensor cores yet). Sequences whose slot or token range is out of bounds are skipped.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_mma.cuh"
#include "kernels/ssm/ssm_scan_kernel.cuh"

namespace kvserve::cuda {

constexpr int kSsdChunk = 32;

/// Floats of dynamic shared memory ssm_chunk_scan_kernel takes for a head of head_dim x
/// state_size: the state, the chunk's x, B and C, the decay matrix, four per-token values.
inline int64_t ssm_chunk_scan_shared_floats(int64_t head_dim, int64_t state_size) {
  const int64_t L = kSsdChunk, row = state_size + 1;
  return head_dim * row + L * head_dim + 2 * L * row + L * L + 4 * L;
}

/// grid (heads, num_seqs); dynamic shared memory ssm_chunk_scan_shared_floats floats.
template <typename T, typename S>
__global__ void ssm_chunk_scan_kernel(SsmScanParams<T, S> p) {
  float* smem = static_cast<float*>(dynamic_shared_memory());
  constexpr int L = kSsdChunk;
  const int64_t s = blockIdx.y, head = blockIdx.x;
  const int64_t slot = p.slots[s], begin = p.cu_seqlens[s], end = p.cu_seqlens[s + 1];
  if (slot < 0 || slot >= p.num_slots || begin < 0 || end < begin || end > p.num_tokens) return;
  const int64_t P = p.head_dim, N = p.state_size, row = N + 1;
  const int64_t g = head / (p.heads / p.groups);
  const int64_t tid = threadIdx.x, threads = blockDim.x;
  float* h = smem;                // [P][row]: the state
  float* xs = h + P * row;        // [L][P]
  float* bs = xs + L * P;         // [L][row]
  float* cs = bs + L * row;       // [L][row]
  float* m = cs + L * row;        // [L][L]: M[t, u], zero above the diagonal
  float* dts = m + L * L;         // [L]: d_u
  float* cum = dts + L;           // [L]: cum_u
  float* into_state = cum + L;    // [L]: exp(cum_last - cum_u) d_u
  float* from_state = into_state + L;  // [L]: exp(cum_t)
  S* state = p.state + (slot * p.heads + head) * P * N;
  for (int64_t k = tid; k < P * N; k += threads) {
    h[(k / N) * row + k % N] = p.has_initial_state[s] ? to_float(state[k]) : 0.0f;
  }
  const float A = p.A[head], D = p.D ? p.D[head] : 0.0f;  // never A_per_state (the launcher's)
  const float bias = p.dt_bias ? p.dt_bias[head] : 0.0f;
  for (int64_t t0 = begin; t0 < end; t0 += L) {
    const int64_t len = end - t0 < L ? end - t0 : L;
    for (int64_t k = tid; k < len * P; k += threads) {
      const int64_t u = k / P;
      xs[k] = to_float(p.x[(t0 + u) * p.x_stride + head * P + k % P]);
    }
    for (int64_t k = tid; k < len * N; k += threads) {
      const int64_t u = k / N, n = k % N;
      bs[u * row + n] = to_float(p.B[(t0 + u) * p.B_stride + g * N + n]);
      cs[u * row + n] = to_float(p.C[(t0 + u) * p.C_stride + g * N + n]);
    }
    for (int64_t u = tid; u < len; u += threads) {
      float d = to_float(p.dt[(t0 + u) * p.dt_stride + head]) + bias;
      if (p.dt_softplus) d = d > 20.0f ? d : log1pf(__expf(d));
      dts[u] = fminf(fmaxf(d, p.dt_min), p.dt_max);
    }
    __syncthreads();
    if (tid == 0) {   // a prefix sum of at most kSsdChunk terms
      float c = 0.0f;
      for (int64_t u = 0; u < len; ++u) cum[u] = c += dts[u] * A;
    }
    __syncthreads();
    for (int64_t u = tid; u < len; u += threads) {
      into_state[u] = __expf(cum[len - 1] - cum[u]) * dts[u];
      from_state[u] = __expf(cum[u]);
    }
    for (int64_t k = tid; k < len * len; k += threads) {
      const int64_t t = k / len, u = k % len;
      float v = 0.0f;
      if (u <= t) {
        for (int64_t n = 0; n < N; ++n) v += cs[t * row + n] * bs[u * row + n];
        v *= __expf(cum[t] - cum[u]) * dts[u];
      }
      m[t * L + u] = v;
    }
    __syncthreads();
    for (int64_t k = tid; k < len * P; k += threads) {
      const int64_t t = k / P, q = k % P;
      float carried = 0.0f;
      for (int64_t n = 0; n < N; ++n) carried += h[q * row + n] * cs[t * row + n];
      float y = from_state[t] * carried + D * xs[t * P + q];
      for (int64_t u = 0; u <= t; ++u) y += m[t * L + u] * xs[u * P + q];
      p.out[(t0 + t) * p.out_stride + head * P + q] = from_float<T>(y);
    }
    __syncthreads();  // every output read the chunk's starting state
    const float decay = __expf(cum[len - 1]);
    for (int64_t k = tid; k < P * N; k += threads) {
      const int64_t q = k / N, n = k % N;
      float v = decay * h[q * row + n];
      for (int64_t u = 0; u < len; ++u) v += into_state[u] * xs[u * P + q] * bs[u * row + n];
      h[q * row + n] = v;
    }
    __syncthreads();  // before the next chunk's loads overwrite what the update read
  }
  __syncthreads();
  for (int64_t k = tid; k < P * N; k += threads) state[k] = from_float<S>(h[(k / N) * row + k % N]);
}

}  // namespace kvserve::cuda
