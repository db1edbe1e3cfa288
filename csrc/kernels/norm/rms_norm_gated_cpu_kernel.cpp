// rms_norm_gated's body; compiled once per CPU capability (see kernels/cpu_dispatch.h): the
// gate's SiLU and each group's sum of squares a vector at a time.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

inline float silu(float z) { return z / (1.0f + std::exp(-z)); }

// v[i] = silu(v[i]) over n values, a vector at a time.
void silu_in_place(float* v, int64_t n) {
  const Vec one(1.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec z = Vec::loadu(v + i);
    (z / (one + z.neg().exp())).store(v + i);
  }
  for (; i < n; ++i) v[i] = silu(v[i]);
}

template <typename T>
void rows_gated(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* gate,
                int64_t gate_stride, const float* w, int64_t rows, int64_t dim,
                int64_t group_size, float eps, bool norm_before_gate) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), g(gate ? dim : 0);  // the row, and silu of its gate
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      const T* zr = gate ? gate + r * gate_stride : nullptr;
      T* o = out + r * out_stride;
      convert_to_float(xr, h.data(), dim);
      if (zr) {
        convert_to_float(zr, g.data(), dim);
        silu_in_place(g.data(), dim);
      }
      if (!w) {  // the gate alone
        for (int64_t i = 0; i < dim; ++i) h[i] *= g[i];
        convert_from_float(h.data(), o, dim);
        continue;
      }
      if (zr && !norm_before_gate) {
        for (int64_t i = 0; i < dim; ++i) h[i] *= g[i];
      }
      for (int64_t begin_g = 0; begin_g < dim; begin_g += group_size) {
        const float sum = dot(h.data() + begin_g, h.data() + begin_g, group_size);
        const float inv = 1.0f / std::sqrt(sum / static_cast<float>(group_size) + eps);
        for (int64_t i = begin_g; i < begin_g + group_size; ++i) {
          if (norm_before_gate) {  // FalconH1: all in fp32, rounded once
            o[i] = static_cast<T>(h[i] * inv * w[i] * (zr ? g[i] : 1.0f));
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
