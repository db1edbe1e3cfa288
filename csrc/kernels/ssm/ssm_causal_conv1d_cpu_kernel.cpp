// ssm_causal_conv1d's body; compiled once per CPU capability (see kernels/cpu_dispatch.h).
// Each (sequence, tile of channels) runs its tokens in order, the pairs in parallel.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// Channels a task takes through its sequence's tokens together: each token's inputs for them
// are one contiguous load (the channels of a token are adjacent; its tokens are rows apart), and
// every step is a loop over the tile's channels that the compiler vectorizes.
constexpr int64_t kTile = 256;

template <typename T, typename S>
void causal_conv1d(T* out, int64_t out_stride, const T* x, int64_t x_stride, const float* weight,
                   const float* bias, S* conv_state, const int32_t* cu, const int32_t* slots,
                   const bool* has_initial_state, int64_t num_seqs, int64_t dim, int64_t kernel,
                   bool silu_out) {
  const int64_t history = kernel - 1;
  const int64_t tiles = (dim + kTile - 1) / kTile;
  at::parallel_for(0, num_seqs * tiles, 1, [&](int64_t begin, int64_t end) {
    // A ring of the tile's last `kernel` inputs: row (oldest + j) % kernel holds the j-th
    // oldest; w[j] the j-th tap of each channel; acc the outputs of one token.
    alignas(64) float window[16][kTile];
    alignas(64) float w[16][kTile];
    alignas(64) float acc[kTile];
    const Vec one(1.0f);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / tiles, c0 = (i % tiles) * kTile, n = std::min(kTile, dim - c0);
      S* state = conv_state + (static_cast<int64_t>(slots[s]) * dim + c0) * history;
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t j = 0; j < history; ++j) {
          window[j][c] = has_initial_state[s] ? static_cast<float>(state[c * history + j]) : 0.0f;
        }
        for (int64_t j = 0; j < kernel; ++j) w[j][c] = weight[(c0 + c) * kernel + j];
      }
      int64_t oldest = 0;
      for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
        convert_to_float(x + t * x_stride + c0, window[(oldest + history) % kernel], n);
        for (int64_t c = 0; c < n; ++c) acc[c] = bias ? bias[c0 + c] : 0.0f;
        for (int64_t j = 0; j < kernel; ++j) {
          const float* row = window[(oldest + j) % kernel];
          const float* tap = w[j];
          for (int64_t c = 0; c < n; ++c) acc[c] += tap[c] * row[c];
        }
        if (silu_out) {
          int64_t c = 0;
          for (; c + Vec::size() <= n; c += Vec::size()) {
            const Vec v = Vec::loadu(acc + c);
            (v / (one + v.neg().exp())).store(acc + c);
          }
          for (; c < n; ++c) acc[c] = silu(acc[c]);
        }
        convert_from_float(acc, out + t * out_stride + c0, n);
        oldest = (oldest + 1) % kernel;
      }
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t j = 0; j < history; ++j) {
          state[c * history + j] = static_cast<S>(window[(oldest + j) % kernel][c]);
        }
      }
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
