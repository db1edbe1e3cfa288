#pragma once
// Random quantized weights for the quantized kernels' emulated tests: the packed q of a format.

#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>

#include <cstdint>

#include "kernels/linear/quantized_linear_kernel.cuh"

namespace kvserve::test_util {

/// q of [rows, k] weights in format F: int8 [rows, k] over all of -128..127, int4 [rows, k / 2]
/// random bytes (two nibbles each), fp8 E4M3 [rows, k] from normals of deviation 8.
template <cuda::QuantFormat F>
at::Tensor random_packed(int64_t rows, int64_t k) {
  if constexpr (F == cuda::QuantFormat::kInt8) {
    return at::randint(-128, 128, {rows, k}, at::kChar);
  } else if constexpr (F == cuda::QuantFormat::kInt4) {
    return at::randint(0, 256, {rows, k / 2}, at::kByte);
  } else {
    return at::randn({rows, k}).mul(8).to(at::kFloat8_e4m3fn);
  }
}

}  // namespace kvserve::test_util
