// Vectorized RMSNorm bodies; compiled once per CPU capability (see kernels/cpu_dispatch.h).
#include <ATen/Parallel.h>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"
#include "kernels/norm/rms_norm_cpu_row.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

template <typename T, typename W>
void rms_norm_rows(T* o, int64_t out_stride, const T* x, int64_t input_stride, const W* w,
                   int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * input_stride;
      normalize_row(o + r * out_stride, row, w, hidden, inverse_rms(row, hidden, eps));
    }
  });
}

void rms_norm_impl(c10::ScalarType dtype, void* out, int64_t out_stride, const void* input,
                   int64_t input_stride, const void* weight, bool fp32_weight, int64_t rows,
                   int64_t hidden, float eps) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    auto* o = static_cast<scalar_t*>(out);
    const auto* x = static_cast<const scalar_t*>(input);
    if (fp32_weight) {
      rms_norm_rows(o, out_stride, x, input_stride, static_cast<const float*>(weight), rows,
                    hidden, eps);
    } else {
      rms_norm_rows(o, out_stride, x, input_stride, static_cast<const scalar_t*>(weight), rows,
                    hidden, eps);
    }
  });
}

template <typename T, typename W>
void fused_add_rms_norm_rows(T* x, int64_t input_stride, T* res, int64_t residual_stride,
                             const W* w, int64_t rows, int64_t hidden, float eps) {
  using scalar_t = T;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = x + r * input_stride;
        scalar_t* rr = res + r * residual_stride;
        // The sum is rounded to the model dtype before normalizing, as the reference models do.
        int64_t i = 0;
        for (; i + Vec::size() <= hidden; i += Vec::size()) {
          store_from_float(rr + i, load_as_float(rr + i) + load_as_float(xr + i));
        }
        for (; i < hidden; ++i) {
          rr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        }
        normalize_row(xr, rr, w, hidden, inverse_rms(rr, hidden, eps));
      }
    });
}

void fused_add_rms_norm_impl(c10::ScalarType dtype, void* input, int64_t input_stride,
                             void* residual, int64_t residual_stride, const void* weight,
                             bool fp32_weight, int64_t rows, int64_t hidden, float eps) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    auto* x = static_cast<scalar_t*>(input);
    auto* res = static_cast<scalar_t*>(residual);
    if (fp32_weight) {
      fused_add_rms_norm_rows(x, input_stride, res, residual_stride,
                              static_cast<const float*>(weight), rows, hidden, eps);
    } else {
      fused_add_rms_norm_rows(x, input_stride, res, residual_stride,
                              static_cast<const scalar_t*>(weight), rows, hidden, eps);
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(rms_norm_stub, &rms_norm_impl);
KVSERVE_REGISTER_CPU_KERNEL(fused_add_rms_norm_stub, &fused_add_rms_norm_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
