// layer_norm's body, vectorized; compiled once per CPU capability (see kernels/cpu_dispatch.h).
#include <ATen/Parallel.h>

#include <cmath>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

inline float sum_all(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

template <typename T>
void layer_norm_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, const float* w,
                     const float* b, int64_t rows, int64_t hidden, float eps) {
  const int64_t n = Vec::size();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * out_stride;
      Vec acc(0.0f);
      int64_t i = 0;
      for (; i + n <= hidden; i += n) acc = acc + load_as_float(xr + i);
      float sum = sum_all(acc);
      for (; i < hidden; ++i) sum += static_cast<float>(xr[i]);
      const float mean = sum / static_cast<float>(hidden);
      const Vec mean_v(mean);
      acc = Vec(0.0f);
      for (i = 0; i + n <= hidden; i += n) {
        const Vec d = load_as_float(xr + i) - mean_v;
        acc = at::vec::fmadd(d, d, acc);
      }
      float squares = sum_all(acc);
      for (; i < hidden; ++i) {
        const float d = static_cast<float>(xr[i]) - mean;
        squares += d * d;
      }
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      const Vec inv_v(inv);
      for (i = 0; i + n <= hidden; i += n) {
        Vec y = (load_as_float(xr + i) - mean_v) * inv_v * Vec::loadu(w + i);
        if (b) y = y + Vec::loadu(b + i);
        store_from_float(o + i, y);
      }
      for (; i < hidden; ++i) {
        float y = (static_cast<float>(xr[i]) - mean) * inv * w[i];
        if (b) y += b[i];
        o[i] = static_cast<T>(y);
      }
    }
  });
}

void layer_norm_impl(c10::ScalarType dtype, void* out, int64_t out_stride, const void* input,
                     int64_t input_stride, const float* weight, const float* bias, int64_t rows,
                     int64_t hidden, float eps) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    layer_norm_rows(static_cast<scalar_t*>(out), out_stride,
                    static_cast<const scalar_t*>(input), input_stride, weight, bias, rows, hidden,
                    eps);
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(layer_norm_stub, &layer_norm_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
