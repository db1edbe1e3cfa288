#pragma once
// CUDA body of clamped_swiglu_and_mul (contract: clamped_swiglu_and_mul.h): the shared
// gated-activation body with gpt-oss's clamped gate. Raw pointers only, no torch headers; the
// launcher checks shapes and dtypes.

#include "kernels/activation/gated_activation_kernel.cuh"

namespace kvserve::cuda {

/// (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
struct ClampedSwigluGate {
  float alpha, limit;
  __device__ float operator()(float gate, float up) const {
    const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
  }
};

}  // namespace kvserve::cuda
