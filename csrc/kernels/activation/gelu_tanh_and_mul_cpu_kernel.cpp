// Vectorized GELU(tanh)-and-multiply (GeGLU gate) body; compiled once per CPU capability.
#include <ATen/Parallel.h>

#include <cmath>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

void gelu_tanh_and_mul_impl(c10::ScalarType dtype, void* out, int64_t out_stride,
                            const void* input, int64_t input_stride, int64_t num_tokens,
                            int64_t d) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    auto* o = static_cast<scalar_t*>(out);
    const auto* x = static_cast<const scalar_t*>(input);
    const Vec half(0.5f), one(1.0f), root(kSqrt2OverPi), cubic(kCubic);
    at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = x + t * input_stride;
        const scalar_t* up = gate + d;
        scalar_t* dst = o + t * out_stride;
        int64_t i = 0;
        for (; i + Vec::size() <= d; i += Vec::size()) {
          const Vec g = load_as_float(gate + i);
          const Vec inner = root * at::vec::fmadd(cubic * g * g, g, g);
          store_from_float(dst + i, half * g * (one + inner.tanh()) * load_as_float(up + i));
        }
        for (; i < d; ++i) {
          const float g = static_cast<float>(gate[i]);
          const float inner = kSqrt2OverPi * (g + kCubic * g * g * g);
          dst[i] = static_cast<scalar_t>(0.5f * g * (1.0f + std::tanh(inner)) *
                                         static_cast<float>(up[i]));
        }
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(gelu_tanh_and_mul_stub, &gelu_tanh_and_mul_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
