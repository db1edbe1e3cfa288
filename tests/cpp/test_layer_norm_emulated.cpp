// layer_norm's CUDA body run by the CUDA emulator (cuda_emulator.h) with the launcher's block
// size, against the CPU op: rows that fill no warp, rows wider than the block, strided rows,
// rows far from zero mean, with and without a bias, in place, each dtype.
#include "cuda_emulator.h"

#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "kernels/norm/layer_norm.h"
#include "kernels/norm/layer_norm_kernel.cuh"
#include "tensor_values.h"

namespace kvserve {
namespace {

template <typename T>
void run_case(at::ScalarType dtype, int64_t hidden, bool with_bias, double tolerance) {
  const int threads = static_cast<int>(std::min<int64_t>(1024, (hidden + 31) / 32 * 32));
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " hidden " + std::to_string(hidden) +
               (with_bias ? " with bias" : ""));
  at::manual_seed(3);
  const int64_t tokens = 3;
  const at::Tensor input = at::randn({tokens, hidden + 3}).add_(20).to(dtype).narrow(1, 1, hidden);
  const at::Tensor weight = at::randn({hidden});
  const at::Tensor bias = at::randn({hidden});
  const std::optional<at::Tensor> b = with_bias ? std::optional<at::Tensor>(bias) : std::nullopt;
  at::Tensor expected = at::randn({tokens, hidden}).to(dtype);
  at::Tensor actual = expected.clone();
  ops::layer_norm(expected, input, weight, b, 1e-5);
  emu::launch(cuda::layer_norm_kernel<T>, dim3(tokens), dim3(threads), 0,
              static_cast<T*>(actual.data_ptr()), actual.stride(0),
              static_cast<const T*>(input.data_ptr()), input.stride(0),
              weight.data_ptr<float>(), with_bias ? bias.data_ptr<float>() : nullptr, hidden,
              1e-5f);
  EXPECT_LE(test_util::worst_relative_error(expected, actual), tolerance) << "layer_norm";

  at::Tensor in_place = input.contiguous();
  emu::launch(cuda::layer_norm_kernel<T>, dim3(tokens), dim3(threads), 0,
              static_cast<T*>(in_place.data_ptr()), in_place.stride(0),
              static_cast<const T*>(in_place.data_ptr()), in_place.stride(0),
              weight.data_ptr<float>(), with_bias ? bias.data_ptr<float>() : nullptr, hidden,
              1e-5f);
  EXPECT_TRUE(in_place.equal(actual)) << "in place";
}

template <typename T>
void run_all(at::ScalarType dtype, double tolerance) {
  for (const int64_t hidden : {1, 5, 33, 1000, 1024, 1025, 4099}) {
    for (const bool with_bias : {false, true}) run_case<T>(dtype, hidden, with_bias, tolerance);
  }
}

TEST(LayerNormEmulated, MatchesTheCpuOpInEveryDtype) {
  run_all<float>(at::kFloat, 1e-4);
  run_all<__nv_bfloat16>(at::kBFloat16, 1e-2);
  run_all<__half>(at::kHalf, 2e-3);
}

}  // namespace
}  // namespace kvserve
