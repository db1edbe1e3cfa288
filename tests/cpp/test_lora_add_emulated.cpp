// lora_add's CUDA kernel body run by the CUDA emulator (cuda_emulator.h) with the launcher's
// launch shape (one block of 256 threads per token, rank floats of shared memory), against the
// CPU op: awkward feature sizes and ranks, strided rows, tokens without an adapter, each dtype.
#include "cuda_emulator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/linear/lora_add.h"
#include "kernels/linear/lora_add_kernel.cuh"
#include "tensor_values.h"

namespace kvserve {
namespace {

template <typename T>
void run_case(at::ScalarType dtype, int64_t in_features, int64_t out_features, int rank,
              const std::vector<int32_t>& slot_values, double tolerance) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " in " + std::to_string(in_features) +
               " out " + std::to_string(out_features) + " rank " + std::to_string(rank));
  at::manual_seed(3);
  const int64_t tokens = static_cast<int64_t>(slot_values.size());
  const int num_slots = 3;
  // Rows strided: views of wider tensors, as the fused projections pass them.
  const at::Tensor x = at::randn({tokens, in_features + 5}).to(dtype).narrow(1, 2, in_features);
  const at::Tensor base = at::randn({tokens, out_features + 3}).to(dtype);
  const at::Tensor lora_a = at::randn({num_slots, rank, in_features}).to(dtype);
  const at::Tensor lora_b = at::randn({num_slots, rank, out_features}).to(dtype);
  at::Tensor slots = at::empty({tokens}, at::kInt);
  std::copy(slot_values.begin(), slot_values.end(), slots.data_ptr<int32_t>());
  at::Tensor scales = at::empty({num_slots}, at::kFloat);
  for (int s = 0; s < num_slots; ++s) scales.data_ptr<float>()[s] = 0.25f * (s + 1);

  at::Tensor expected_base = base.clone(), actual_base = base.clone();
  at::Tensor expected = expected_base.narrow(1, 1, out_features);
  at::Tensor actual = actual_base.narrow(1, 1, out_features);
  ops::lora_add(expected, x, lora_a, lora_b, slots, scales);
  emu::launch(cuda::lora_add_kernel<T>, dim3(tokens), dim3(256), rank * sizeof(float),
              static_cast<T*>(actual.data_ptr()), actual.stride(0),
              static_cast<const T*>(x.data_ptr()), x.stride(0),
              static_cast<const T*>(lora_a.data_ptr()), static_cast<const T*>(lora_b.data_ptr()),
              slots.data_ptr<int32_t>(), scales.data_ptr<float>(), num_slots, in_features,
              out_features, rank);
  // The whole base: columns outside out's view must be untouched.
  EXPECT_LE(test_util::worst_relative_error(expected_base, actual_base), tolerance);
}

TEST(LoraAddEmulated, MatchesTheCpuOpInEveryDtype) {
  const std::vector<int32_t> slots = {0, -1, 2, 2, 1, -1, 0};
  for (const auto& [in, out, rank] : std::vector<std::tuple<int64_t, int64_t, int>>{
           {37, 45, 1}, {64, 20, 5}, {130, 300, 16}, {8, 8, 33}}) {
    run_case<float>(at::kFloat, in, out, rank, slots, 1e-5);
    run_case<__nv_bfloat16>(at::kBFloat16, in, out, rank, slots, 1e-2);
    run_case<__half>(at::kHalf, in, out, rank, slots, 2e-3);
  }
}

TEST(LoraAddEmulated, TokensWithoutAnAdapterAreLeftAlone) {
  run_case<float>(at::kFloat, 16, 24, 4, {-1, -1}, 0.0);
}

TEST(LoraAddEmulated, SlotsOutsideThePoolAddNothing) {
  // The CPU op rejects them; the CUDA body, which cannot check device values, skips them.
  const at::Tensor x = at::randn({3, 16}), lora_a = at::randn({2, 4, 16});
  const at::Tensor lora_b = at::randn({2, 4, 8}), base = at::randn({3, 8});
  at::Tensor out = base.clone(), slots = at::empty({3}, at::kInt), scales = at::empty({2});
  const int32_t values[3] = {2, -2, 1000};
  std::copy(values, values + 3, slots.data_ptr<int32_t>());
  scales.fill_(1.0);
  emu::launch(cuda::lora_add_kernel<float>, dim3(3), dim3(256), 4 * sizeof(float),
              out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0),
              lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), slots.data_ptr<int32_t>(),
              scales.data_ptr<float>(), 2, int64_t{16}, int64_t{8}, 4);
  EXPECT_TRUE(out.equal(base));
}

}  // namespace
}  // namespace kvserve
