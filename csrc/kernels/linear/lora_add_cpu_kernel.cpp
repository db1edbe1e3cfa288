// Vectorized lora_add body (contract: lora_add.h); compiled once per CPU capability. Per token:
// the rank shrink (one dot product per row of A_s over the fp32 input row), then the expand
// (rank scaled rows of B_s^T added to the fp32 output row), one rounding at the end.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

void lora_add_impl(const LoraAddArgs& a) {
  KVSERVE_DISPATCH_FLOATING(a.dtype, [&] {
    auto* out = static_cast<scalar_t*>(a.out);
    const auto* x = static_cast<const scalar_t*>(a.x);
    const auto* lora_a = static_cast<const scalar_t*>(a.lora_a);
    const auto* lora_b = static_cast<const scalar_t*>(a.lora_b);
    at::parallel_for(0, a.num_tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(a.in_features), acc(a.out_features), weights(
          std::max(a.in_features, a.out_features)), shrunk(a.rank);
      for (int64_t t = begin; t < end; ++t) {
        const int32_t s = a.slots[t];
        if (s < 0) continue;
        convert_to_float(x + t * a.x_stride, row.data(), a.in_features);
        const scalar_t* a_s = lora_a + static_cast<int64_t>(s) * a.rank * a.in_features;
        const scalar_t* b_s = lora_b + static_cast<int64_t>(s) * a.rank * a.out_features;
        for (int64_t r = 0; r < a.rank; ++r) {
          convert_to_float(a_s + r * a.in_features, weights.data(), a.in_features);
          shrunk[r] = a.scales[s] * dot(weights.data(), row.data(), a.in_features);
        }
        scalar_t* dst = out + t * a.out_stride;
        convert_to_float(dst, acc.data(), a.out_features);
        for (int64_t r = 0; r < a.rank; ++r) {
          convert_to_float(b_s + r * a.out_features, weights.data(), a.out_features);
          axpy(acc.data(), shrunk[r], weights.data(), a.out_features);
        }
        convert_from_float(acc.data(), dst, a.out_features);
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(lora_add_stub, &lora_add_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
