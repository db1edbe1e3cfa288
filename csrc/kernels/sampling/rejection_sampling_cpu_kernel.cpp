// Rejection sampling body: per sequence, the acceptance tests of its drafts in order, then one
// draw from the residual or the bonus distribution. One sequence per task; O(vocab) per row read.
#include <ATen/Parallel.h>

#include <cmath>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

// Sum of a row in double; not finite (or <= 0) when the row is no distribution.
double row_total(const float* p, int64_t vocab) {
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!(p[i] >= 0.0f)) return -1.0;  // negative or NaN
    total += p[i];
  }
  return std::isfinite(total) ? total : -1.0;
}

// Inverse CDF over weights w(i) (a lambda), total > 0: the first i whose cumulative sum exceeds
// u * total; rounding can leave the target beyond the final sum, then the last positive weight.
template <typename Weight>
int64_t draw(Weight w, int64_t vocab, double total, float u) {
  const double target = static_cast<double>(u) * total;
  double cumulative = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < vocab; ++i) {
    const double wi = w(i);
    if (wi <= 0.0) continue;
    cumulative += wi;
    last = i;
    if (cumulative > target) return i;
  }
  return last;
}

void rejection_sample_impl(const float* target, int64_t target_stride, const float* draft,
                           int64_t draft_stride, int64_t vocab, const int64_t* draft_ids,
                           const int64_t* cu_num_drafts, int64_t batch, const float* uniform,
                           int64_t* out, int64_t out_stride, int64_t* num_accepted) {
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first_draft = cu_num_drafts[b];
      const int64_t k = cu_num_drafts[b + 1] - first_draft;
      const int64_t first_row = first_draft + b;  // target rows of b
      const float u_final = uniform[first_row + k];
      int64_t* o = out + b * out_stride;
      int64_t j = 0;
      for (; j < k; ++j) {
        const float* p = target + (first_row + j) * target_stride;
        const int64_t x = draft_ids[first_draft + j];
        const double p_total = row_total(p, vocab);
        if (p_total <= 0.0) {  // no target distribution here: the sequence ends in an error
          o[j] = -1;
          break;
        }
        const float* q = draft ? draft + (first_draft + j) * draft_stride : nullptr;
        const float px = x >= 0 && x < vocab ? p[x] : 0.0f;
        const float qx = q ? (x >= 0 && x < vocab ? q[x] : 0.0f) : 1.0f;
        if (uniform[first_row + j] * qx < px) {  // accepted with probability min(1, p/q)
          o[j] = x;
          continue;
        }
        // Rejected: draw from max(p - q, 0), normalised. It has mass whenever the rejection had a
        // chance; if rounding left none, p itself (the only distribution consistent with p = q).
        auto residual = [&](int64_t i) {
          const double qi = q ? q[i] : (i == x ? 1.0 : 0.0);
          return std::max(static_cast<double>(p[i]) - qi, 0.0);
        };
        double r_total = 0.0;
        for (int64_t i = 0; i < vocab; ++i) r_total += residual(i);
        o[j] = r_total > 0.0 ? draw(residual, vocab, r_total, u_final)
                             : draw([&](int64_t i) { return static_cast<double>(p[i]); }, vocab,
                                    p_total, u_final);
        break;
      }
      num_accepted[b] = j;
      if (j < k) continue;
      const float* p = target + (first_row + k) * target_stride;  // every draft accepted: bonus
      const double p_total = row_total(p, vocab);
      o[k] = p_total > 0.0
                 ? draw([&](int64_t i) { return static_cast<double>(p[i]); }, vocab, p_total,
                        u_final)
                 : -1;
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(rejection_sample_stub, &rejection_sample_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
