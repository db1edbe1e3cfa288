// Vectorized body of fused_moe's weighted combine; compiled once per CPU capability.
#include <ATen/Parallel.h>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

void moe_combine_impl(c10::ScalarType dtype, const void* expert_out, const float* weights,
                      void* out, int64_t num_tokens, int64_t k, int64_t hidden) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    const auto* y = static_cast<const scalar_t*>(expert_out);
    auto* o = static_cast<scalar_t*>(out);
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* dst = o + t * hidden;
        int64_t i = 0;
        for (; i + Vec::size() <= hidden; i += Vec::size()) {
          Vec acc(0.0f);
          for (int64_t j = 0; j < k; ++j) {
            acc = at::vec::fmadd(Vec(weights[t * k + j]),
                                 load_as_float(y + (t * k + j) * hidden + i), acc);
          }
          store_from_float(dst + i, acc);
        }
        for (; i < hidden; ++i) {
          float acc = 0.0f;
          for (int64_t j = 0; j < k; ++j) {
            acc += weights[t * k + j] * static_cast<float>(y[(t * k + j) * hidden + i]);
          }
          dst[i] = static_cast<scalar_t>(acc);
        }
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(moe_combine_stub, &moe_combine_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
