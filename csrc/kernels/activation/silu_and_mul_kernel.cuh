#pragma once
// CUDA body of silu_and_mul (contract: silu_and_mul.h): the shared gated-activation body with
// SiLU on the gate. Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include "kernels/activation/gated_activation_kernel.cuh"

namespace kvserve::cuda {

/// silu(g) * u, silu(g) = g / (1 + exp(-g)).
struct SiluGate {
  __device__ float operator()(float g, float u) const { return g / (1.0f + expf(-g)) * u; }
};

}  // namespace kvserve::cuda
