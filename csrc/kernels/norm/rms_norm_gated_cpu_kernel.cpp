// rms_norm_gated's body; compiled once per CPU capability (see kernels/cpu_dispatch.h).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

inline float silu(float z) { return z / (1.0f + std::exp(-z)); }

template <typename T>
void rows_gated(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* gate,
                int64_t gate_stride, const float* w, int64_t rows, int64_t dim,
                int64_t group_size, float eps, bool norm_before_gate) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      const T* zr = gate ? gate + r * gate_stride : nullptr;
      T* o = out + r * out_stride;
      if (!w) {  // the gate alone
        for (int64_t i = 0; i < dim; ++i) {
          o[i] = static_cast<T>(static_cast<float>(xr[i]) * silu(static_cast<float>(zr[i])));
        }
        continue;
      }
      for (int64_t i = 0; i < dim; ++i) {
        float v = static_cast<float>(xr[i]);
        if (zr && !norm_before_gate) v *= silu(static_cast<float>(zr[i]));
        h[i] = v;
      }
      for (int64_t g = 0; g < dim; g += group_size) {
        float sum = 0.0f;
        for (int64_t i = g; i < g + group_size; ++i) sum += h[i] * h[i];
        const float inv = 1.0f / std::sqrt(sum / static_cast<float>(group_size) + eps);
        for (int64_t i = g; i < g + group_size; ++i) {
          if (norm_before_gate) {  // FalconH1: all in fp32, rounded once
            const float gated = zr ? silu(static_cast<float>(zr[i])) : 1.0f;
            o[i] = static_cast<T>(h[i] * inv * w[i] * gated);
          } else {  // normalized, rounded to the dtype, then weighted: transformers' Mamba2 order
            o[i] = static_cast<T>(static_cast<float>(static_cast<T>(h[i] * inv)) * w[i]);
          }
        }
      }
    }
  });
}

void rms_norm_gated_impl(c10::ScalarType dtype, void* out, int64_t out_stride, const void* input,
                         int64_t input_stride, const void* gate, int64_t gate_stride,
                         const float* weight, int64_t rows, int64_t dim, int64_t group_size,
                         float eps, bool norm_before_gate) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    rows_gated(static_cast<scalar_t*>(out), out_stride, static_cast<const scalar_t*>(input),
               input_stride, static_cast<const scalar_t*>(gate), gate_stride, weight, rows, dim,
               group_size, eps, norm_before_gate);
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(rms_norm_gated_stub, &rms_norm_gated_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
