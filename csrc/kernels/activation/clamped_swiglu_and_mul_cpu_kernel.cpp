// Vectorized clamped SwiGLU (gpt-oss's gate) body; compiled once per CPU capability.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

void clamped_swiglu_and_mul_impl(c10::ScalarType dtype, void* out, int64_t out_stride,
                                 const void* input, int64_t input_stride, int64_t num_tokens,
                                 int64_t d, float alpha, float limit) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    auto* o = static_cast<scalar_t*>(out);
    const auto* x = static_cast<const scalar_t*>(input);
    const Vec one(1.0f), top(limit), bottom(-limit), a(alpha);
    at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = x + t * input_stride;
        const scalar_t* up = gate + d;
        scalar_t* dst = o + t * out_stride;
        int64_t i = 0;
        for (; i + Vec::size() <= d; i += Vec::size()) {
          const Vec g = at::vec::minimum(load_as_float(gate + i), top);
          const Vec u = at::vec::clamp(load_as_float(up + i), bottom, top);
          store_from_float(dst + i, (u + one) * (g / (one + (g * a).neg().exp())));
        }
        for (; i < d; ++i) {
          const float g = std::min(static_cast<float>(gate[i]), limit);
          const float u = std::clamp(static_cast<float>(up[i]), -limit, limit);
          dst[i] = static_cast<scalar_t>((u + 1.0f) * (g / (1.0f + std::exp(-alpha * g))));
        }
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(clamped_swiglu_and_mul_stub, &clamped_swiglu_and_mul_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
