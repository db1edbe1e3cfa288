// Sampling bodies: temperature, top-k, top-p and min-p filtering of fp32 logits, then argmax or
// inverse-CDF sampling from a given uniform number. One row per request; per CPU capability.
// The top-k and top-p thresholds come from histograms of the logits' order-preserving integer
// keys (no sort), with the CUDA body's rule, so both keep the same tokens, ties whole; softmax
// weights are fp64 exponentials, vectorized. A row with a NaN or +inf logit, or with every logit
// -inf, has no distribution to sample: the filter leaves it as it is and the draw returns -1.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// An order-preserving image of a float that is not NaN: a < b <=> float_key(a) < float_key(b),
// a == b <=> equal keys (-0 maps like +0); the CUDA body's, so both choose the same thresholds.
// Branch-free (a branch on the sign of random logits mispredicts half the time: 6x slower).
inline uint32_t float_key(float x) {
  uint32_t bits;
  const float value = x + 0.0f;  // -0 + 0 = +0; everything else unchanged
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t negative = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31);
  return bits ^ (negative | 0x80000000u);  // negative: ~bits; else: the sign bit set
}

inline float key_float(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? key & 0x7fffffffu : ~key;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Whether a row is a distribution (no NaN, no +inf, a logit above -inf), and its maximum.
struct RowScan {
  bool samplable;
  float max;
};

RowScan scan_row(const float* x, int64_t vocab) {
  Vec bad(0.0f), finite(0.0f), max(kNegInf);
  int64_t i = 0;
  for (; i + Vec::size() <= vocab; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    bad = bad | v.isnan() | (v == Vec(kInf));
    finite = finite | (v != Vec(kNegInf));
    max = at::vec::maximum(max, v);
  }
  const int all_lanes = (1 << Vec::size()) - 1;
  bool any_bad = bad.zero_mask() != all_lanes, any_finite = finite.zero_mask() != all_lanes;
  float row_max = kNegInf;
  if (i > 0) row_max = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, max);
  for (; i < vocab; ++i) {
    any_bad = any_bad || std::isnan(x[i]) || x[i] == kInf;
    any_finite = any_finite || x[i] != kNegInf;
    row_max = std::max(row_max, x[i]);
  }
  return {!any_bad && any_finite, row_max};
}

// Scratch of one thread's rows, kept by the thread between calls (a fresh vocab-sized buffer per
// call would cost its page faults every step).
struct Scratch {
  std::vector<double> weights, histogram, bucket_weights;
  std::vector<float> candidates;
  std::vector<uint32_t> bucket_keys;
};

// Picks the bucket where the running weight (from `below`) first exceeds target, or, where
// rounding leaves none, the last bucket of positive weight; `below` becomes the weight under it.
uint32_t choose_bucket(const std::vector<double>& histogram, double target, double& below) {
  double cumulative = below, last_positive_below = below;
  uint32_t last_positive = 0;
  for (size_t b = 0; b < histogram.size(); ++b) {
    if (cumulative + histogram[b] > target) {
      below = cumulative;
      return static_cast<uint32_t>(b);
    }
    if (histogram[b] > 0.0) {
      last_positive = static_cast<uint32_t>(b);
      last_positive_below = cumulative;
    }
    cumulative += histogram[b];
  }
  below = last_positive_below;
  return last_positive;
}

// The smallest key u with W(u) > target, where W(u) sums weight(i) >= 0 over the tokens whose
// float_key is <= u: the k-th largest logit with unit weights and target vocab - k, the top-p
// threshold with softmax weights (the CUDA body's radix_select, same rounding fallback). Needs
// 0 <= target < W(max key) in exact arithmetic. Three histogram levels of the key's bits (12, 10,
// 10): the first over the row, the others over the tokens of the bucket chosen, gathered.
template <typename Weight>
uint32_t select_key(const float* x, int64_t vocab, double target, Weight weight, Scratch& s) {
  s.histogram.assign(size_t{1} << 12, 0.0);
  for (int64_t i = 0; i < vocab; ++i) s.histogram[float_key(x[i]) >> 20] += weight(i);
  double below = 0.0;
  const uint32_t top = choose_bucket(s.histogram, target, below);
  s.bucket_keys.clear();
  s.bucket_weights.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t key = float_key(x[i]);
    if (key >> 20 != top) continue;
    s.bucket_keys.push_back(key);
    s.bucket_weights.push_back(weight(i));
  }
  uint32_t prefix = top << 20;
  for (const int shift : {10, 0}) {
    s.histogram.assign(size_t{1} << 10, 0.0);
    for (size_t j = 0; j < s.bucket_keys.size(); ++j) {
      s.histogram[(s.bucket_keys[j] >> shift) & 1023u] += s.bucket_weights[j];
    }
    const uint32_t digit = choose_bucket(s.histogram, target, below);
    prefix |= digit << shift;
    size_t kept = 0;  // the tokens of the chosen bucket, in place
    for (size_t j = 0; j < s.bucket_keys.size(); ++j) {
      if (((s.bucket_keys[j] >> shift) & 1023u) != digit) continue;
      s.bucket_keys[kept] = s.bucket_keys[j];
      s.bucket_weights[kept++] = s.bucket_weights[j];
    }
    s.bucket_keys.resize(kept);
    s.bucket_weights.resize(kept);
  }
  return prefix;
}

// weights[i] = exp(x[i] - max) in fp64 for the tokens >= from, else 0 (x[i] - max rounded to fp32
// first in the filter, as the CUDA body does; in fp64 in the draw). Returns their sum.
template <bool kFloatDifference>
double exp_weights(const float* x, int64_t vocab, float max, float from, double* weights) {
  using VecD = at::vec::Vectorized<double>;
  constexpr double kZeroWeight = -std::numeric_limits<double>::infinity();  // exp: 0
  for (int64_t i = 0; i < vocab; ++i) {  // branch-free, so the compiler vectorizes it
    const double d = kFloatDifference ? static_cast<double>(x[i] - max)
                                      : static_cast<double>(x[i]) - static_cast<double>(max);
    weights[i] = x[i] < from ? kZeroWeight : d;
  }
  VecD sums(0.0);
  int64_t i = 0;
  for (; i + VecD::size() <= vocab; i += VecD::size()) {
    const VecD w = VecD::loadu(weights + i).exp();
    w.store(weights + i);
    sums = sums + w;
  }
  double total = at::vec::vec_reduce_all<double>([](VecD& a, VecD& b) { return a + b; }, sums);
  for (; i < vocab; ++i) {
    weights[i] = std::exp(weights[i]);
    total += weights[i];
  }
  return total;
}

void filter_row(float* x, int64_t vocab, float temperature, int64_t top_k, float top_p,
                float min_p, Scratch& s) {
  // Divide (not multiply by the reciprocal) in both loops: equal logits must stay equal
  // wherever they sit, or top-k would split ties; this also matches torch's logits / t.
  const Vec t(temperature);
  int64_t i = 0;
  for (; i + Vec::size() <= vocab; i += Vec::size()) (Vec::loadu(x + i) / t).store(x + i);
  for (; i < vocab; ++i) x[i] /= temperature;
  const RowScan scan = scan_row(x, vocab);
  if (!scan.samplable) return;  // the draw reports it
  float threshold = kNegInf;  // logits below it are removed
  if (top_k > 0 && top_k < vocab) {  // the (vocab - k + 1)-th smallest is the k-th largest
    threshold = key_float(select_key(x, vocab, static_cast<double>(vocab - top_k),
                                     [](int64_t) { return 1.0; }, s));
  }
  if (top_p < 1.0f) {  // softmax weights of what top-k kept, unnormalized
    // After top-k only its survivors carry weight: top-p looks at them alone.
    const float* candidates = x;
    int64_t count = vocab;
    if (threshold > kNegInf) {
      s.candidates.clear();
      for (int64_t j = 0; j < vocab; ++j) {
        if (x[j] >= threshold) s.candidates.push_back(x[j]);
      }
      candidates = s.candidates.data();
      count = static_cast<int64_t>(s.candidates.size());
    }
    s.weights.resize(count);
    const double total =
        exp_weights<true>(candidates, count, scan.max, threshold, s.weights.data());
    const double target = (1.0 - static_cast<double>(top_p)) * total;
    // Where no mass exceeds the target (p <= 0, NaN) only the maximum stays.
    const float p_threshold =
        target < total ? key_float(select_key(candidates, count, target,
                                              [&](int64_t j) { return s.weights[j]; }, s))
                       : scan.max;
    threshold = std::max(threshold, p_threshold);
  }
  if (min_p > 0.0f) {  // p_i < min_p * p_max <=> x_i < max + log(min_p); log rounded once
    threshold = std::max(
        threshold, scan.max + static_cast<float>(std::log(static_cast<double>(min_p))));
  }
  if (threshold == kNegInf) return;
  const Vec cut(threshold), removed(kNegInf);
  for (i = 0; i + Vec::size() <= vocab; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    Vec::blendv(v, removed, v < cut).store(x + i);
  }
  for (; i < vocab; ++i) {
    if (x[i] < threshold) x[i] = kNegInf;
  }
}

void sampling_filter_impl(float* logits, int64_t stride, int64_t rows, int64_t vocab,
                          const float* temperature, const int64_t* top_k, const float* top_p,
                          const float* min_p) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      if (temperature[r] == 0.0f) continue;  // greedy rows keep their raw logits
      filter_row(logits + r * stride, vocab, temperature[r], top_k[r], top_p[r], min_p[r],
                 scratch);
    }
  });
}

// Tokens per block of the draw's block sums.
constexpr int64_t kDrawBlock = 2048;

// The first token whose fp64 cumulative weight exceeds uniform * total: the block sums locate the
// block, a walk through it the token. Where rounding leaves the target at or above the total:
// the argmax; inside the block: its last token of positive weight (as the CUDA body does).
int64_t draw_row(const float* x, int64_t vocab, float max, int64_t best, float uniform,
                 Scratch& s) {
  s.weights.resize(vocab);
  exp_weights<false>(x, vocab, max, kNegInf, s.weights.data());
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  s.histogram.assign(blocks, 0.0);
  double total = 0.0;
  using VecD = at::vec::Vectorized<double>;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kDrawBlock, last = std::min(vocab, first + kDrawBlock);
    VecD sums(0.0);
    int64_t i = first;
    for (; i + VecD::size() <= last; i += VecD::size()) sums = sums + VecD::loadu(&s.weights[i]);
    double sum = at::vec::vec_reduce_all<double>([](VecD& a, VecD& c) { return a + c; }, sums);
    for (; i < last; ++i) sum += s.weights[i];
    s.histogram[b] = sum;
    total += sum;
  }
  const double target = static_cast<double>(uniform) * total;
  double before = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (before + s.histogram[b] <= target) {
      before += s.histogram[b];
      continue;
    }
    int64_t chosen = best;
    double cumulative = before;
    for (int64_t i = b * kDrawBlock; i < std::min(vocab, (b + 1) * kDrawBlock); ++i) {
      if (s.weights[i] == 0.0) continue;  // removed (-inf) tokens are never drawn
      chosen = i;
      cumulative += s.weights[i];
      if (cumulative > target) break;
    }
    return chosen;
  }
  return best;
}

void sampling_sample_impl(const float* logits, int64_t stride, int64_t rows, int64_t vocab,
                          const float* temperature, const float* uniform, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits + r * stride;
      const RowScan scan = scan_row(x, vocab);
      if (!scan.samplable) {
        out[r] = -1;
        continue;
      }
      // Argmax picks the first of equal maxima, like torch.argmax.
      const int64_t best = std::find(x, x + vocab, scan.max) - x;
      out[r] = temperature[r] == 0.0f ? best
                                      : draw_row(x, vocab, scan.max, best, uniform[r], scratch);
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(sampling_filter_stub, &sampling_filter_impl);
KVSERVE_REGISTER_CPU_KERNEL(sampling_sample_stub, &sampling_sample_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
