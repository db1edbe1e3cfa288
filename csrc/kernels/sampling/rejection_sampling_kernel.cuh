#pragma once
// CUDA body of rejection_sample (contract: rejection_sampling.h): one thread block per sequence;
// the block reduces each row it reads (validity, residual mass) and draws by a chunked inverse
// CDF. Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cstdint>

namespace kvserve::cuda {

namespace rejection_detail {

template <int kThreads>
__device__ double block_sum(double value, double* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

__device__ inline int64_t clamp(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : v > hi ? hi : v;
}

// Weight of token i: p (mode 0), or max(p - q, 0) with q a row or the point mass at x (mode 1).
__device__ double weight(const float* p, const float* q, int64_t x, int64_t i, int mode) {
  if (mode == 0) return p[i];
  const double qi = q ? static_cast<double>(q[i]) : (i == x ? 1.0 : 0.0);
  const double r = static_cast<double>(p[i]) - qi;
  return r > 0.0 ? r : 0.0;
}

// The first i whose cumulative weight exceeds u * total (the last positive weight if rounding
// leaves none), over chunks of kThreads tokens with a block-wide inclusive scan per chunk.
template <int kThreads>
__device__ int64_t draw(const float* p, const float* q, int64_t x, int mode, int64_t vocab,
                        double total, float u, double* scratch) {
  __shared__ int64_t found;
  __shared__ unsigned long long last_positive_plus_one;  // 0: no positive weight yet
  const double target = static_cast<double>(u) * total;
  if (threadIdx.x == 0) {
    found = -1;
    last_positive_plus_one = 0;
  }
  __syncthreads();
  double before = 0.0;
  for (int64_t base = 0; base < vocab; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const double w = i < vocab ? weight(p, q, x, i, mode) : 0.0;
    if (w > 0.0) atomicMax(&last_positive_plus_one, static_cast<unsigned long long>(i + 1));
    scratch[threadIdx.x] = w;
    __syncthreads();
    for (int offset = 1; offset < kThreads; offset *= 2) {  // Hillis-Steele inclusive scan
      const double add = threadIdx.x >= offset ? scratch[threadIdx.x - offset] : 0.0;
      __syncthreads();
      scratch[threadIdx.x] += add;
      __syncthreads();
    }
    const double inclusive = before + scratch[threadIdx.x];
    const double exclusive = inclusive - w;
    if (w > 0.0 && inclusive > target && exclusive <= target) found = i;
    const double chunk = scratch[kThreads - 1];
    __syncthreads();
    if (found >= 0) break;
    before += chunk;
  }
  const int64_t result =
      found >= 0 ? found : static_cast<int64_t>(last_positive_plus_one) - 1;
  __syncthreads();
  return result;
}

}  // namespace rejection_detail

/// grid = batch blocks of kThreads threads. The CPU body's arguments plus num_drafts (N):
/// target [N + B, vocab] and draft [N, vocab] (null: point masses) with row strides, out
/// [B, out_stride] prefilled with -1, num_accepted [B]. cu_num_drafts may sit on the device,
/// unchecked (checking would synchronise): each sequence's draft range is clamped into [0, N]
/// and to out_stride - 1 drafts, so that bad values give wrong tokens, never a read or write out
/// of bounds. Draft ids outside [0, vocab) have p = q = 0 (rejected).
template <int kThreads>
__global__ void rejection_sample_kernel(const float* __restrict__ target, int64_t target_stride,
                                        const float* __restrict__ draft, int64_t draft_stride,
                                        int64_t vocab, const int64_t* __restrict__ draft_ids,
                                        const int64_t* __restrict__ cu_num_drafts,
                                        int64_t num_drafts, const float* __restrict__ uniform,
                                        int64_t* __restrict__ out, int64_t out_stride,
                                        int64_t* __restrict__ num_accepted) {
  using namespace rejection_detail;
  __shared__ double scratch[kThreads];
  const int64_t b = blockIdx.x;
  const int64_t first_draft = clamp(cu_num_drafts[b], 0, num_drafts);
  const int64_t end = clamp(cu_num_drafts[b + 1], first_draft, num_drafts);
  const int64_t k = end - first_draft < out_stride - 1 ? end - first_draft : out_stride - 1;
  const int64_t first_row = first_draft + b;
  const float u_final = uniform[first_row + k];
  int64_t* o = out + b * out_stride;
  int64_t j = 0;
  for (; j <= k; ++j) {
    const float* p = target + (first_row + j) * target_stride;
    double partial = 0.0;
    bool valid = true;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      valid = valid && p[i] >= 0.0f;  // false for NaN too
      partial += p[i];
    }
    const double invalid = block_sum<kThreads>(valid ? 0.0 : 1.0, scratch);
    const double p_total = block_sum<kThreads>(partial, scratch);
    if (invalid > 0.0 || !(p_total > 0.0) || isinf(p_total)) {
      if (threadIdx.x == 0) o[j] = -1;
      break;
    }
    if (j == k) {  // every draft accepted: the bonus token
      const int64_t t = draw<kThreads>(p, nullptr, -1, 0, vocab, p_total, u_final, scratch);
      if (threadIdx.x == 0) o[j] = t;
      break;
    }
    const int64_t x = draft_ids[first_draft + j];
    const float* q = draft ? draft + (first_draft + j) * draft_stride : nullptr;
    const float px = x >= 0 && x < vocab ? p[x] : 0.0f;
    const float qx = q ? (x >= 0 && x < vocab ? q[x] : 0.0f) : 1.0f;
    if (uniform[first_row + j] * qx < px) {
      if (threadIdx.x == 0) o[j] = x;
      continue;
    }
    double r_partial = 0.0;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) r_partial += weight(p, q, x, i, 1);
    const double r_total = block_sum<kThreads>(r_partial, scratch);
    const int64_t t = r_total > 0.0
                          ? draw<kThreads>(p, q, x, 1, vocab, r_total, u_final, scratch)
                          : draw<kThreads>(p, nullptr, -1, 0, vocab, p_total, u_final, scratch);
    if (threadIdx.x == 0) o[j] = t;
    break;
  }
  if (threadIdx.x == 0) num_accepted[b] = j < k ? j : k;
}

}  // namespace kvserve::cuda
