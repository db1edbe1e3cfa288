// rms_norm's and fused_add_rms_norm's CUDA bodies run by the CUDA emulator (cuda_emulator.h)
// with the launcher's plan (norm_plan: block size and values kept per thread, or the strided
// loop past 16 x 1024), against the CPU op: hidden sizes that fill no warp, each plan's edges,
// strided rows, model-dtype and fp32 weights, each dtype.
#include "cuda_emulator.h"

#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/norm/rms_norm.h"
#include "kernels/norm/rms_norm_kernel.cuh"
#include "tensor_values.h"

namespace kvserve {
namespace {

template <typename T, typename W>
void run_case(at::ScalarType dtype, at::ScalarType weight_type, int64_t hidden,
              double tolerance) {
  const cuda::NormPlan plan = cuda::norm_plan(hidden);
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " weight " + c10::toString(weight_type) +
               " hidden " + std::to_string(hidden) + " threads " + std::to_string(plan.threads) +
               " per thread " + std::to_string(plan.per_thread));
  EXPECT_EQ(plan.threads % 32, 0);
  EXPECT_LE(plan.threads, 1024);
  if (plan.per_thread > 0) {
    EXPECT_GE(static_cast<int64_t>(plan.threads) * plan.per_thread, hidden);
  }
  at::manual_seed(2);
  const int64_t tokens = 3;
  // Rows strided: views of wider tensors.
  const at::Tensor input = at::randn({tokens, hidden + 3}).to(dtype).narrow(1, 1, hidden);
  const at::Tensor residual = at::randn({tokens, hidden + 5}).to(dtype).narrow(1, 2, hidden);
  const at::Tensor weight = at::randn({hidden}).to(weight_type);
  const auto* w = static_cast<const W*>(weight.data_ptr());
  const dim3 grid(tokens), block(plan.threads);

  at::Tensor expected = at::randn({tokens, hidden}).to(dtype);
  at::Tensor actual = expected.clone();
  ops::rms_norm(expected, input, weight, 1e-6);
  cuda::dispatch_per_thread(plan.per_thread, [&](auto values) {
    constexpr int P = decltype(values)::value;
    emu::launch(cuda::rms_norm_kernel<T, W, P>, grid, block, 0,
                static_cast<T*>(actual.data_ptr()), actual.stride(0),
                static_cast<const T*>(input.data_ptr()), input.stride(0), w, hidden, 1e-6f);
  });
  EXPECT_LE(test_util::worst_relative_error(expected, actual), tolerance) << "rms_norm";

  at::Tensor expected_x = input.clone(), expected_r = residual.clone();
  at::Tensor actual_x = input.clone(), actual_r = residual.clone();
  ops::fused_add_rms_norm(expected_x, expected_r, weight, 1e-6);
  cuda::dispatch_per_thread(plan.per_thread, [&](auto values) {
    constexpr int P = decltype(values)::value;
    emu::launch(cuda::fused_add_rms_norm_kernel<T, W, P>, grid, block, 0,
                static_cast<T*>(actual_x.data_ptr()), actual_x.stride(0),
                static_cast<T*>(actual_r.data_ptr()), actual_r.stride(0), w, hidden, 1e-6f);
  });
  EXPECT_TRUE(actual_r.equal(expected_r)) << "the residual sum is one rounding of x + r";
  EXPECT_LE(test_util::worst_relative_error(expected_x, actual_x), tolerance) << "fused_add_rms_norm";
}

template <typename T>
void run_all(at::ScalarType dtype, double tolerance) {
  // 1 value a thread up to 512, 2 to 1,024, ... 16 to 16,384, then the strided loop.
  for (const int64_t hidden : {1, 5, 33, 512, 513, 1000, 4096, 5120, 16384, 16390}) {
    run_case<T, T>(dtype, dtype, hidden, tolerance);
  }
  run_case<T, float>(dtype, at::kFloat, 2050, tolerance);  // Gemma's fp32 weights
}

TEST(RmsNormEmulated, MatchesTheCpuOpInEveryDtypeAndPlan) {
  run_all<float>(at::kFloat, 1e-5);
  run_all<__nv_bfloat16>(at::kBFloat16, 1e-2);
  run_all<__half>(at::kHalf, 2e-3);
}

}  // namespace
}  // namespace kvserve
