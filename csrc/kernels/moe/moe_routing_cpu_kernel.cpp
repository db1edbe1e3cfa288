// Vectorized body of moe_routing (contract: kernels/moe/moe_routing.h); compiled once per CPU
// capability. Per token: fp32 scores over all experts (vectorized exp), then the best groups and
// the best experts by insertion into short sorted lists (top_k and topk_group are small).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

// Offers (value, id) to the list best[0..count) kept sorted by value, best first, at most
// `capacity` long. Strictly greater values move ahead, so among equal values the one offered
// first (the lower id) stays ahead; a NaN moves ahead of nothing, and every number of it.
inline void offer(float value, int64_t id, float* best, int64_t* best_ids, int64_t& count,
                  int64_t capacity) {
  int64_t at = count;
  while (at > 0 && (value > best[at - 1] || (std::isnan(best[at - 1]) && !std::isnan(value)))) {
    --at;
  }
  if (at >= capacity) return;
  const int64_t last = count < capacity ? count : capacity - 1;
  for (int64_t i = last; i > at; --i) {
    best[i] = best[i - 1];
    best_ids[i] = best_ids[i - 1];
  }
  best[at] = value;
  best_ids[at] = id;
  if (count < capacity) ++count;
}

// scores[e] = softmax or sigmoid of logits[e], fp32.
template <typename T>
void score(const T* logits, int64_t n, bool sigmoid, float* scores) {
  convert_to_float(logits, scores, n);
  int64_t i = 0;
  if (sigmoid) {
    const Vec one(1.0f);
    for (; i + Vec::size() <= n; i += Vec::size()) {
      (one / (one + (-Vec::loadu(scores + i)).exp())).store(scores + i);
    }
    for (; i < n; ++i) scores[i] = 1.0f / (1.0f + std::exp(-scores[i]));
    return;
  }
  const float max = at::vec::reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, scores, n);
  float sum = 0.0f;
  const Vec shift(max);
  Vec acc(0.0f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(scores + i) - shift).exp();
    e.store(scores + i);
    acc = acc + e;
  }
  sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) {
    scores[i] = std::exp(scores[i] - max);
    sum += scores[i];
  }
  const float inv = 1.0f / sum;
  at::vec::map([inv](Vec x) { return x * Vec(inv); }, scores, scores, n);
}

void moe_routing_impl(const MoERoutingArgs& a) {
  const int64_t num_experts = a.num_experts, k = a.top_k;
  const int64_t per_group = num_experts / a.n_group;
  KVSERVE_DISPATCH_FLOATING(a.dtype, [&] {
    at::parallel_for(0, a.num_tokens, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(num_experts), choice(num_experts), group_best(a.n_group);
      std::vector<float> best(k);
      std::vector<int64_t> group_ids(a.n_group), kept(a.topk_group);
      for (int64_t t = begin; t < end; ++t) {
        score(static_cast<const scalar_t*>(a.logits) + t * a.logits_stride, num_experts,
              a.sigmoid, scores.data());
        for (int64_t e = 0; e < num_experts; ++e) {
          choice[e] = a.bias ? scores[e] + a.bias[e] : scores[e];
        }
        // The candidate groups, in id order (so that equal choices keep the lower id first).
        int64_t num_kept = 1;
        kept[0] = 0;
        if (a.n_group > 1) {
          int64_t count = 0;
          for (int64_t g = 0; g < a.n_group; ++g) {
            float top2[2];
            int64_t top2_ids[2], n2 = 0;
            for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
              offer(choice[e], e, top2, top2_ids, n2, a.sigmoid ? 2 : 1);
            }
            offer(a.sigmoid ? top2[0] + top2[1] : top2[0], g, group_best.data(),
                  group_ids.data(), count, a.topk_group);
          }
          num_kept = count;
          for (int64_t i = 0; i < num_kept; ++i) kept[i] = group_ids[i];
          std::sort(kept.begin(), kept.begin() + num_kept);
        }
        const int64_t span = a.n_group > 1 ? per_group : num_experts;
        int64_t* ids = a.ids + t * k;
        int64_t count = 0;
        for (int64_t i = 0; i < num_kept; ++i) {
          for (int64_t e = kept[i] * span; e < (kept[i] + 1) * span; ++e) {
            offer(choice[e], e, best.data(), ids, count, k);
          }
        }
        float* weights = a.weights + t * k;
        float sum = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          weights[j] = scores[ids[j]];
          sum += weights[j];
        }
        for (int64_t j = 0; j < k; ++j) {
          if (a.renormalize) weights[j] /= sum + 1e-20f;
          weights[j] *= a.routed_scaling_factor;
        }
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(moe_routing_stub, &moe_routing_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
