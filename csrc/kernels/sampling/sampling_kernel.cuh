#pragma once
// CUDA bodies of sampling_filter_logits and sampling_from_logits (contract: sampling.h), one
// thread block per row, the row read from global memory (L2) in every pass.
//  - filter: one pass divides by the temperature, checks the row is samplable and finds its max;
//    top-k and top-p thresholds come from a radix select over the order-preserving integer image
//    of the floats (8 passes of 4 bits each, fp64 histograms reduced over the block in a fixed
//    order: deterministic, no sort); min-p is max + log(min_p) as on the CPU; a last pass sets
//    what falls below the highest threshold to -inf. Ties at every threshold are kept.
//  - draw: one pass for the samplable check and the first argmax, one for the fp64 softmax sum
//    (each warp sums a contiguous segment of the row); the warp whose segment holds the crossing
//    sums 32 runs of it, and the lane whose run holds it walks that run in token order to the
//    first cumulative sum above u * total.
// Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

namespace sampling_detail {

constexpr int kDigitBits = 4;                 // bits of the key chosen per radix pass
constexpr int kBuckets = 1 << kDigitBits;     // histogram buckets per pass
constexpr int kUnroll = 16;                   // loads in flight per thread in a pass
constexpr uint32_t kSign = 0x80000000u;

// An order-preserving image of a float that is not NaN: a < b <=> float_key(a) < float_key(b),
// and a == b <=> equal keys (-0 maps like +0).
__device__ inline uint32_t float_key(float x) {
  const uint32_t bits = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (bits & kSign) ? ~bits : bits | kSign;
}

__device__ inline float key_float(uint32_t key) {
  return __uint_as_float((key & kSign) ? key & ~kSign : ~key);
}

// Calls f(i, x[i]) for i = first, first + stride, ... < end in increasing order (a fixed order,
// so sums are deterministic), kUnroll loads at a time: a pass over a row in L2 is bound by the
// loads in flight, not by bandwidth.
template <typename F>
__device__ inline void for_each_strided(const float* x, int64_t first, int64_t end, int64_t stride,
                                        F&& f) {
  for (int64_t i = first; i < end; i += kUnroll * stride) {
    float v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) v[j] = i + j * stride < end ? x[i + j * stride] : 0.0f;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (i + j * stride < end) f(i + j * stride, v[j]);
    }
  }
}

// This thread's tokens of a row: threadIdx.x + j * kThreads.
template <int kThreads, typename F>
__device__ inline void for_each_token(const float* x, int64_t vocab, F&& f) {
  for_each_strided(x, threadIdx.x, vocab, kThreads, f);
}

// The smallest key u with W(u) > target, where W(u) sums weight(x_i) >= 0 over the tokens with
// float_key(x_i) <= u: the k-th largest logit with unit weights and target vocab - k, the top-p
// threshold with softmax weights. Every thread gets the same key. Needs 0 <= target < W(max key)
// in exact arithmetic; where rounding leaves no bucket of a pass above target, the pass takes its
// last bucket of positive weight (the crossing is at the top of the group). `scratch`: __shared__
// double[32 * kBuckets].
template <int kThreads, typename Weight>
__device__ uint32_t radix_select(const float* x, int64_t vocab, double target, Weight weight,
                                 double* scratch) {
  uint32_t prefix = 0;  // the key bits chosen so far, in place
  double below = 0.0;   // W of the tokens whose keys lie below the group of keys with that prefix
#pragma unroll 1
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    const uint32_t group_mask = shift + kDigitBits == 32 ? 0u : ~0u << (shift + kDigitBits);
    double sums[kBuckets];
#pragma unroll
    for (int b = 0; b < kBuckets; ++b) sums[b] = 0.0;
    for_each_token<kThreads>(x, vocab, [&](int64_t, float v) {
      const uint32_t key = float_key(v);
      if ((key & group_mask) != prefix) return;
      const double w = weight(v);
      const uint32_t digit = (key >> shift) & (kBuckets - 1);
      // Unrolled compares keep the histogram in registers (an indexed array would spill).
#pragma unroll
      for (int b = 0; b < kBuckets; ++b) {
        if (digit == static_cast<uint32_t>(b)) sums[b] += w;
      }
    });
    block_sum_n(sums, scratch);
    // Every thread holds the same sums, so every thread chooses the same bucket.
    int chosen = -1, last_positive = 0;
    double cumulative = below, chosen_below = below, last_positive_below = below;
#pragma unroll
    for (int b = 0; b < kBuckets; ++b) {
      if (chosen < 0 && cumulative + sums[b] > target) {
        chosen = b;
        chosen_below = cumulative;
      }
      if (sums[b] > 0.0) {
        last_positive = b;
        last_positive_below = cumulative;
      }
      cumulative += sums[b];
    }
    if (chosen < 0) {
      chosen = last_positive;
      chosen_below = last_positive_below;
    }
    prefix |= static_cast<uint32_t>(chosen) << shift;
    below = chosen_below;
  }
  return prefix;
}

// A token's (value, index) packed so that the larger pack is the larger value, then the lower
// index: the block maximum of packs is the first argmax. Needs vocab <= 2^32.
__device__ inline unsigned long long argmax_pack(float v, int64_t i) {
  return static_cast<unsigned long long>(float_key(v)) << 32 |
         (0xffffffffu - static_cast<uint32_t>(i));
}

}  // namespace sampling_detail

/// Grid (num_rows), block kThreads (a multiple of 32). In place on logits [num_rows, stride]:
/// temperature, then top-k (k <= 0 or >= vocab: off), top-p (>= 1: off) and min-p (<= 0: off)
/// set removed logits to -inf; greedy rows (temperature 0) and rows that are no distribution after
/// the temperature (a NaN or +inf, or all -inf) stay as they are. top-k keeps the logits >= the
/// k-th largest; top-p keeps x when the softmax mass of all logits <= x exceeds 1 - p, and always
/// the maximum; so tied logits share one fate.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    sampling_filter_kernel(float* __restrict__ logits, int64_t stride, int64_t vocab,
                           const float* __restrict__ temperature,
                           const int64_t* __restrict__ top_k, const float* __restrict__ top_p,
                           const float* __restrict__ min_p) {
  using namespace sampling_detail;
  __shared__ double scratch[32 * kBuckets];
  __shared__ float max_scratch[32];
  const int64_t r = blockIdx.x;
  const float t = temperature[r];
  if (t == 0.0f) return;  // greedy rows keep their raw logits
  float* x = logits + r * stride;
  bool bad = false, any_finite = false;
  float local_max = -INFINITY;
  // Divide with IEEE rounding (as the CPU does, whatever the compile flags): equal logits must
  // stay equal, or top-k would split ties. Each thread later reads back only what it wrote here.
  for_each_token<kThreads>(x, vocab, [&](int64_t i, float v) {
    v = __fdiv_rn(v, t);
    x[i] = v;
    bad = bad || isnan(v) || v == INFINITY;
    any_finite = any_finite || v != -INFINITY;
    local_max = fmaxf(local_max, v);
  });
  const bool row_bad = __syncthreads_or(bad);
  const bool row_any_finite = __syncthreads_or(any_finite);
  if (row_bad || !row_any_finite) return;  // the draw reports it
  // Finite: no +inf, and a finite logit beats the -FLT_MAX that pads the reduction.
  const float row_max = block_max(local_max, max_scratch);

  float threshold = -INFINITY;  // logits below it are removed
  const int64_t k = top_k[r];
  if (k > 0 && k < vocab) {  // the (vocab - k + 1)-th smallest is the k-th largest
    const auto count = [](float) { return 1.0; };
    threshold = key_float(
        radix_select<kThreads>(x, vocab, static_cast<double>(vocab - k), count, scratch));
  }
  const float p = top_p[r];
  if (p < 1.0f) {
    // Softmax weights of what top-k kept, unnormalized, as the CPU computes them.
    const float kept_from = threshold;
    const auto mass = [=](float v) {
      return v >= kept_from ? exp(static_cast<double>(v - row_max)) : 0.0;
    };
    double partial[1] = {0.0};
    for_each_token<kThreads>(x, vocab, [&](int64_t, float v) { partial[0] += mass(v); });
    block_sum_n(partial, scratch);
    const double total = partial[0];
    const double target = (1.0 - static_cast<double>(p)) * total;
    // Where no mass exceeds the target (p <= 0, NaN) only the maximum stays.
    const float p_threshold =
        target < total ? key_float(radix_select<kThreads>(x, vocab, target, mass, scratch))
                       : row_max;
    threshold = fmaxf(threshold, p_threshold);
  }
  const float m = min_p[r];
  if (m > 0.0f) {  // p_i < min_p * p_max <=> x_i < max + log(min_p); log rounded once to fp32
    threshold = fmaxf(threshold, row_max + static_cast<float>(log(static_cast<double>(m))));
  }
  if (threshold == -INFINITY) return;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    if (x[i] < threshold) x[i] = -INFINITY;
  }
}

/// Grid (num_rows), block kThreads (a multiple of 32, at most 1024). out[r]: -1 when row r is no
/// distribution (a NaN or +inf, or all -inf); else its first argmax for temperature 0; else the
/// first token whose fp64 cumulative softmax weight exceeds uniform[r] * total (where rounding
/// leaves none: the argmax, or the last token of positive weight in the part of the row that the
/// sums of its parts point to). Logits [num_rows, stride], vocab <= 2^32.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    sampling_sample_kernel(const float* __restrict__ logits, int64_t stride, int64_t vocab,
                           const float* __restrict__ temperature,
                           const float* __restrict__ uniform, int64_t* __restrict__ out) {
  using namespace sampling_detail;
  constexpr int kWarps = kThreads / 32;
  __shared__ unsigned long long best_scratch[32];
  __shared__ double segment_sums[kWarps];
  const int64_t r = blockIdx.x;
  const float* x = logits + r * stride;
  bool bad = false, any_finite = false;
  unsigned long long best = 0;
  for_each_token<kThreads>(x, vocab, [&](int64_t i, float v) {
    bad = bad || isnan(v) || v == INFINITY;
    any_finite = any_finite || v != -INFINITY;
    best = max(best, argmax_pack(v, i));
  });
  const bool row_bad = __syncthreads_or(bad);
  const bool row_any_finite = __syncthreads_or(any_finite);
  if (row_bad || !row_any_finite) {
    if (threadIdx.x == 0) out[r] = -1;
    return;
  }
  const auto larger = [](unsigned long long a, unsigned long long b) { return a > b ? a : b; };
  best = block_reduce(best, larger, 0ull, best_scratch);
  const int64_t best_index = 0xffffffffu - static_cast<uint32_t>(best);
  if (temperature[r] == 0.0f) {
    if (threadIdx.x == 0) out[r] = best_index;
    return;
  }
  const double row_max = key_float(static_cast<uint32_t>(best >> 32));

  // Each warp sums the weights of one contiguous segment of the row, lanes on adjacent tokens.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t segment = (vocab + kWarps - 1) / kWarps;
  const int64_t begin = min(vocab, warp * segment), end = min(vocab, begin + segment);
  double partial = 0.0;
  for_each_strided(x, begin + lane, end, 32, [&](int64_t, float v) {
    partial += exp(static_cast<double>(v) - row_max);
  });
  const auto add = [](double a, double b) { return a + b; };
  partial = warp_reduce(partial, add);
  if (lane == 0) segment_sums[warp] = partial;
  __syncthreads();
  // Every thread walks the segment sums alike: the total, then the segment holding the crossing.
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += segment_sums[w];
  const double target = static_cast<double>(uniform[r]) * total;
  double before = 0.0;
  int crossing = -1;
  for (int w = 0; w < kWarps; ++w) {
    if (before + segment_sums[w] > target) {
      crossing = w;
      break;
    }
    before += segment_sums[w];
  }
  if (crossing < 0) {  // rounding left target at or above the total, as the CPU allows for
    if (threadIdx.x == 0) out[r] = best_index;
    return;
  }
  if (warp != crossing) return;
  // That warp splits its segment into 32 runs, one per lane, and sums them; the lane whose run
  // holds the crossing walks it token by token (the run is in L1 by then).
  const int64_t run = (end - begin + 31) / 32;
  const int64_t run_begin = min(end, begin + lane * run), run_end = min(end, run_begin + run);
  double run_sum = 0.0;
  for_each_strided(x, run_begin, run_end, 1, [&](int64_t, float v) {
    run_sum += exp(static_cast<double>(v) - row_max);
  });
  double inclusive = run_sum;  // inclusive scan of the run sums over the lanes
  for (int offset = 1; offset < 32; offset *= 2) {
    const double left = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += left;
  }
  double exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = 0.0;
  const unsigned hits = __ballot_sync(0xffffffffu, run_sum > 0.0 && before + inclusive > target);
  // Rounding can leave every run at or below target: then the last run of positive weight.
  const unsigned positive = __ballot_sync(0xffffffffu, run_sum > 0.0);
  const int walker = hits != 0 ? __ffs(hits) - 1 : 31 - __clz(positive);
  if (lane != walker) return;
  double cumulative = before + exclusive;
  int64_t chosen = -1;
  for (int64_t i = run_begin; i < run_end; ++i) {
    const double w = exp(static_cast<double>(x[i]) - row_max);
    if (w == 0.0) continue;  // removed (-inf) tokens are never drawn
    chosen = i;
    cumulative += w;
    if (cumulative > target) break;
  }
  out[r] = chosen;  // without a crossing: the run's last token of positive weight
}

}  // namespace kvserve::cuda
