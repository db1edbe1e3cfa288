#pragma once
// CUDA body of ssm_scan (contract: ssm_scan.h), in its recurrent form: one block per (sequence,
// head) keeps the head's state [head_dim, state_size] in fp32 shared memory for the sequence's
// tokens; warp w updates rows p = w, w + warps, ... (its lanes over the state dimension) and
// reduces each row against C. The launcher runs it for decode batches (one token a sequence);
// batches with prefill run the chunked form (ssm_chunk_scan_kernel.cuh). Sequences whose slot or
// token range is out of bounds are skipped. Raw pointers only.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_mma.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// The operands, token strides in elements; A, D, dt_bias fp32 (D, dt_bias may be null); A
/// [heads], or [heads, state_size] with A_per_state (Mamba; the recurrent form only).
template <typename T, typename S>
struct SsmScanParams {
  T* out;
  int64_t out_stride;
  const T* x;
  int64_t x_stride;
  const T* dt;
  int64_t dt_stride;
  const T* B;
  int64_t B_stride;
  const T* C;
  int64_t C_stride;
  const float* A;
  bool A_per_state;
  const float* D;
  const float* dt_bias;
  S* state;
  const int32_t* cu_seqlens;
  const int32_t* slots;
  const bool* has_initial_state;
  int64_t num_tokens, num_slots, heads, head_dim, groups, state_size;
  bool dt_softplus;
  float dt_min, dt_max;
};

/// Threads a block of the recurrent form: a warp a row of the state, up to eight.
inline int ssm_scan_threads(int64_t head_dim) {
  return 32 * static_cast<int>(head_dim < 8 ? head_dim : 8);
}

/// grid (heads, num_seqs), ssm_scan_threads(head_dim) threads; dynamic shared memory head_dim *
/// state_size floats.
template <typename T, typename S>
__global__ void ssm_scan_kernel(SsmScanParams<T, S> p) {
  float* h = static_cast<float*>(dynamic_shared_memory());
  const int64_t s = blockIdx.y, head = blockIdx.x;
  const int64_t slot = p.slots[s], begin = p.cu_seqlens[s], end = p.cu_seqlens[s + 1];
  if (slot < 0 || slot >= p.num_slots || begin < 0 || end < begin || end > p.num_tokens) return;
  const int64_t P = p.head_dim, N = p.state_size, size = P * N;
  const int64_t g = head / (p.heads / p.groups);
  S* state = p.state + (slot * p.heads + head) * size;
  for (int64_t k = threadIdx.x; k < size; k += blockDim.x) {
    h[k] = p.has_initial_state[s] ? to_float(state[k]) : 0.0f;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const float A = p.A_per_state ? 0.0f : p.A[head], D = p.D ? p.D[head] : 0.0f;
  const float bias = p.dt_bias ? p.dt_bias[head] : 0.0f;
  for (int64_t t = begin; t < end; ++t) {
    float d = to_float(p.dt[t * p.dt_stride + head]) + bias;
    if (p.dt_softplus) d = d > 20.0f ? d : log1pf(__expf(d));
    d = fminf(fmaxf(d, p.dt_min), p.dt_max);
    const float decay = __expf(d * A);  // unless A_per_state
    const float* A_row = p.A + head * N;
    const T* bt = p.B + t * p.B_stride + g * N;
    const T* ct = p.C + t * p.C_stride + g * N;
    const T* xt = p.x + t * p.x_stride + head * P;
    T* yt = p.out + t * p.out_stride + head * P;
    for (int64_t row = warp; row < P; row += warps) {
      const float xp = to_float(xt[row]);
      float* hr = h + row * N;
      float y = 0.0f;
      for (int64_t n = lane; n < N; n += 32) {
        const float rate = p.A_per_state ? __expf(d * A_row[n]) : decay;
        const float v = rate * hr[n] + d * xp * to_float(bt[n]);
        hr[n] = v;
        y += v * to_float(ct[n]);
      }
      y = warp_sum(y);
      if (lane == 0) yt[row] = from_float<T>(y + D * xp);
    }
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < size; k += blockDim.x) state[k] = from_float<S>(h[k]);
}

}  // namespace kvserve::cuda
