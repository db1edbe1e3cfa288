// Sampling bodies: temperature, top-k, top-p and min-p filtering of fp32 logits, then argmax or
// inverse-CDF sampling from a given uniform number. One row per request; per CPU capability.
// A row with a NaN or +inf logit, or with every logit -inf, has no distribution to sample: the
// filter leaves it as it is and the draw returns -1 for it (never an out-of-range read: the sorts
// below must not see NaN, whose comparisons break their ordering).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keeps the logits >= the k-th largest (ties at the threshold are kept, as in Hugging Face).
void apply_top_k(float* x, int64_t vocab, int64_t k, std::vector<float>& scratch) {
  if (k <= 0 || k >= vocab) return;
  scratch.assign(x, x + vocab);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<>());
  const float threshold = scratch[k - 1];
  for (int64_t i = 0; i < vocab; ++i) {
    if (x[i] < threshold) x[i] = kNegInf;
  }
}

// Removes the least likely tokens whose cumulative probability (ascending) stays <= 1 - p; the
// most likely token always stays.
void apply_top_p(float* x, int64_t vocab, float p, std::vector<int64_t>& order) {
  if (p >= 1.0f) return;
  order.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    if (x[i] != kNegInf) order.push_back(i);
  }
  if (order.empty()) return;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] < x[b]; });
  const float max = x[order.back()];
  double total = 0.0;
  for (int64_t i : order) total += std::exp(static_cast<double>(x[i] - max));
  double cumulative = 0.0;
  const double limit = 1.0 - static_cast<double>(p);
  for (size_t n = 0; n + 1 < order.size(); ++n) {
    cumulative += std::exp(static_cast<double>(x[order[n]] - max)) / total;
    if (cumulative > limit) break;
    x[order[n]] = kNegInf;
  }
}

// Removes tokens whose probability is below min_p times the largest probability.
void apply_min_p(float* x, int64_t vocab, float min_p) {
  if (min_p <= 0.0f) return;
  const float max = *std::max_element(x, x + vocab);
  const float threshold = max + std::log(min_p);  // p_i < min_p * p_max  <=>  x_i < max + log(min_p)
  for (int64_t i = 0; i < vocab; ++i) {
    if (x[i] < threshold) x[i] = kNegInf;
  }
}

// True when the row is a distribution: no NaN, no +inf, at least one finite logit.
bool samplable(const float* x, int64_t vocab) {
  bool any_finite = false;
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(x[i]) || x[i] == std::numeric_limits<float>::infinity()) return false;
    any_finite = any_finite || x[i] != kNegInf;
  }
  return any_finite;
}

void sampling_filter_impl(float* logits, int64_t stride, int64_t rows, int64_t vocab,
                          const float* temperature, const int64_t* top_k, const float* top_p,
                          const float* min_p) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<int64_t> order;
    for (int64_t r = begin; r < end; ++r) {
      if (temperature[r] == 0.0f) continue;  // greedy rows keep their raw logits
      float* x = logits + r * stride;
      // Divide (not multiply by the reciprocal) in both loops: equal logits must stay equal
      // wherever they sit, or top-k would split ties; this also matches torch's logits / t.
      const Vec t(temperature[r]);
      int64_t i = 0;
      for (; i + Vec::size() <= vocab; i += Vec::size()) (Vec::loadu(x + i) / t).store(x + i);
      for (; i < vocab; ++i) x[i] /= temperature[r];
      if (!samplable(x, vocab)) continue;  // the draw reports it
      apply_top_k(x, vocab, top_k[r], scratch);
      apply_top_p(x, vocab, top_p[r], order);
      apply_min_p(x, vocab, min_p[r]);
    }
  });
}

void sampling_sample_impl(const float* logits, int64_t stride, int64_t rows, int64_t vocab,
                          const float* temperature, const float* uniform, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits + r * stride;
      if (!samplable(x, vocab)) {
        out[r] = -1;
        continue;
      }
      // Argmax picks the first of equal maxima, like torch.argmax.
      const int64_t best = std::max_element(x, x + vocab) - x;
      if (temperature[r] == 0.0f) {
        out[r] = best;
        continue;
      }
      const double max = x[best];
      double total = 0.0;
      for (int64_t i = 0; i < vocab; ++i) total += std::exp(x[i] - max);
      const double target = static_cast<double>(uniform[r]) * total;
      double cumulative = 0.0;
      int64_t chosen = best;  // rounding can leave target just above the final sum
      for (int64_t i = 0; i < vocab; ++i) {
        if (x[i] == kNegInf) continue;
        cumulative += std::exp(x[i] - max);
        if (cumulative > target) {
          chosen = i;
          break;
        }
      }
      out[r] = chosen;
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(sampling_filter_stub, &sampling_filter_impl);
KVSERVE_REGISTER_CPU_KERNEL(sampling_sample_stub, &sampling_sample_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
