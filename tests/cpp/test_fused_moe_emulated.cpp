// fused_moe's CUDA body (the gate/up pass, then the down pass and the weighted sum) run by the
// CUDA emulator (cuda_emulator.h) with the launcher's block shape, against the CPU op: SwiGLU,
// gpt-oss's clamped SwiGLU and experts without a gate (relu2), with biases and without, an
// expert id outside the table (contributes nothing), each input dtype.
#include "cuda_emulator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/moe/fused_moe.h"
#include "kernels/moe/fused_moe_kernel.cuh"
#include "tensor_values.h"

namespace kvserve {
namespace {

constexpr int kWarps = 4;  // the launcher's block: 4 warps, an output each

template <typename T>
void run_case(at::ScalarType dtype, const std::string& activation, bool biases,
              double tolerance) {
  SCOPED_TRACE(activation + " " + c10::toString(dtype) + (biases ? " biases" : ""));
  at::manual_seed(11);
  const int64_t num_tokens = 3, k = 2, num_experts = 3, hidden_size = 40, inter = 24;
  const bool gated = activation != "relu2";
  const int64_t rows = gated ? 2 * inter : inter;
  std::vector<at::Tensor> w13, w2;
  std::vector<const T*> w13_ptr, w2_ptr;
  for (int64_t e = 0; e < num_experts; ++e) {
    w13.push_back(at::randn({rows, hidden_size}).div(std::sqrt(double(hidden_size))).to(dtype));
    w2.push_back(at::randn({hidden_size, inter}).div(std::sqrt(double(inter))).to(dtype));
    w13_ptr.push_back(static_cast<const T*>(w13.back().data_ptr()));
    w2_ptr.push_back(static_cast<const T*>(w2.back().data_ptr()));
  }
  const at::Tensor b13 = at::randn({num_experts, rows}).to(dtype);
  const at::Tensor b2 = at::randn({num_experts, hidden_size}).to(dtype);
  const auto bias = [&](const at::Tensor& b) {
    return biases ? std::optional<at::Tensor>(b) : std::nullopt;
  };
  const at::Tensor hidden = at::randn({num_tokens, hidden_size}).to(dtype);
  at::Tensor ids = at::empty({num_tokens, k}, at::kLong);
  const int64_t id_values[] = {0, 2, 1, 1, 2, 0};
  std::copy(std::begin(id_values), std::end(id_values), ids.data_ptr<int64_t>());
  at::Tensor weights = at::rand({num_tokens, k});
  const double alpha = 1.702, limit = 1.5;  // a limit the projections' outputs cross
  const at::Tensor expected = ops::fused_moe(hidden, w13, w2, weights, ids, bias(b13), bias(b2),
                                             activation, alpha, limit);
  const cuda::MoeGate gate{static_cast<float>(alpha),
                           activation == "clamped_swiglu" ? static_cast<float>(limit) : 0.0f,
                           !gated};
  for (const bool bad : {false, true}) {
    SCOPED_TRACE(bad ? "a bad id" : "good ids");
    at::Tensor used = ids.clone();
    if (bad) used.data_ptr<int64_t>()[1] = num_experts;
    at::Tensor act = at::empty({num_tokens * k, inter}, at::kFloat);
    at::Tensor out = at::empty({num_tokens, hidden_size}, dtype);
    const T* b13_ptr = biases ? static_cast<const T*>(b13.data_ptr()) : nullptr;
    const T* b2_ptr = biases ? static_cast<const T*>(b2.data_ptr()) : nullptr;
    emu::launch(cuda::moe_gate_up_kernel<T>,
                dim3(num_tokens * k, static_cast<unsigned int>((inter + kWarps - 1) / kWarps)),
                dim3(32 * kWarps), 0, static_cast<const T*>(hidden.data_ptr()), hidden.stride(0),
                w13_ptr.data(), b13_ptr, static_cast<const int64_t*>(used.data_ptr<int64_t>()),
                k, num_experts, hidden_size, inter, gate, act.data_ptr<float>());
    emu::launch(cuda::moe_down_combine_kernel<T>,
                dim3(num_tokens, static_cast<unsigned int>((hidden_size + kWarps - 1) / kWarps)),
                dim3(32 * kWarps), 0, static_cast<const float*>(act.data_ptr<float>()),
                w2_ptr.data(), b2_ptr, static_cast<const int64_t*>(used.data_ptr<int64_t>()),
                static_cast<const float*>(weights.data_ptr<float>()), k, num_experts,
                hidden_size, inter, static_cast<T*>(out.data_ptr()));
    if (!bad) {
      EXPECT_LE(test_util::worst_relative_error(expected, out), tolerance);
      continue;
    }
    // Token 0 without its second expert: the CPU op with that slot's weight at 0.
    at::Tensor without_weights = weights.clone();
    without_weights.data_ptr<float>()[1] = 0.0f;
    const at::Tensor without = ops::fused_moe(hidden, w13, w2, without_weights, ids, bias(b13),
                                              bias(b2), activation, alpha, limit);
    EXPECT_LE(test_util::worst_relative_error(without, out), tolerance);
  }
}

template <typename T>
void run_all(at::ScalarType dtype, double tolerance) {
  for (const char* activation : {"silu", "clamped_swiglu", "relu2"}) {
    for (const bool biases : {false, true}) run_case<T>(dtype, activation, biases, tolerance);
  }
}

TEST(FusedMoeEmulated, MatchesTheCpuOpForEveryGate) {
  run_all<float>(at::kFloat, 2e-5);
  // The CPU op rounds the gate's inputs and output to the dtype; the body keeps them in fp32.
  run_all<__nv_bfloat16>(at::kBFloat16, 3e-2);
  run_all<__half>(at::kHalf, 4e-3);
}

}  // namespace
}  // namespace kvserve
