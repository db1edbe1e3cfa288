#pragma once
// CUDA body of gelu_tanh_and_mul (contract: gelu_tanh_and_mul.h): the shared gated-activation
// body with GELU's tanh approximation on the gate. Raw pointers only, no torch headers; the
// launcher checks shapes and dtypes.

#include "kernels/activation/gated_activation_kernel.cuh"

namespace kvserve::cuda {

/// gelu_tanh(g) * u, gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))).
struct GeluTanhGate {
  __device__ float operator()(float g, float u) const {
    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + tanhf(inner)) * u;
  }
};

}  // namespace kvserve::cuda
