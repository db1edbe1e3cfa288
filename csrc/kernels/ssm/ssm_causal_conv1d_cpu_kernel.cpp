// ssm_causal_conv1d's body; compiled once per CPU capability (see kernels/cpu_dispatch.h).
// Each (sequence, channel) runs its tokens in order, the pairs in parallel.
#include <ATen/Parallel.h>

#include <cmath>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

template <typename T, typename S>
void causal_conv1d(T* out, int64_t out_stride, const T* x, int64_t x_stride, const float* weight,
                   const float* bias, S* conv_state, const int32_t* cu, const int32_t* slots,
                   const bool* has_initial_state, int64_t num_seqs, int64_t dim, int64_t kernel,
                   bool silu_out) {
  const int64_t history = kernel - 1;
  at::parallel_for(0, num_seqs * dim, 64, [&](int64_t begin, int64_t end) {
    float window[16];  // the channel's last kernel values, oldest first
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / dim, c = i % dim;
      S* state = conv_state + (static_cast<int64_t>(slots[s]) * dim + c) * history;
      for (int64_t j = 0; j < history; ++j) {
        window[j] = has_initial_state[s] ? static_cast<float>(state[j]) : 0.0f;
      }
      const float* w = weight + c * kernel;
      const float b = bias ? bias[c] : 0.0f;
      for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
        window[history] = static_cast<float>(x[t * x_stride + c]);
        float v = b;
        for (int64_t j = 0; j < kernel; ++j) v += w[j] * window[j];
        out[t * out_stride + c] = static_cast<T>(silu_out ? silu(v) : v);
        for (int64_t j = 0; j < history; ++j) window[j] = window[j + 1];
      }
      for (int64_t j = 0; j < history; ++j) state[j] = static_cast<S>(window[j]);
    }
  });
}

void ssm_causal_conv1d_impl(c10::ScalarType dtype, void* out, int64_t out_stride,
                            const void* input, int64_t input_stride, const float* weight,
                            const float* bias, void* conv_state, bool fp32_state,
                            const int32_t* cu_seqlens, const int32_t* slots,
                            const bool* has_initial_state, int64_t num_seqs, int64_t dim,
                            int64_t kernel, bool silu_out) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    auto* o = static_cast<scalar_t*>(out);
    const auto* x = static_cast<const scalar_t*>(input);
    if (fp32_state) {
      causal_conv1d(o, out_stride, x, input_stride, weight, bias, static_cast<float*>(conv_state),
                    cu_seqlens, slots, has_initial_state, num_seqs, dim, kernel, silu_out);
    } else {
      causal_conv1d(o, out_stride, x, input_stride, weight, bias,
                    static_cast<scalar_t*>(conv_state), cu_seqlens, slots, has_initial_state,
                    num_seqs, dim, kernel, silu_out);
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(ssm_causal_conv1d_stub, &ssm_causal_conv1d_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
