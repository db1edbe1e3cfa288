// fused_moe_quantized's CUDA bodies (the gate/up pass, then the down pass and the weighted sum)
// run by the CUDA emulator (cuda_emulator.h) with the launcher's block shape, against the CPU
// op: int8, int4 with zeros and fp8 experts, weight rows read by 16-byte vectors and by 4-byte
// words (the fallback, here for hidden rows off 16 bytes), an expert id outside the table
// (contributes nothing), each input dtype; SwiGLU experts and experts without a gate (relu2).
#include "cuda_emulator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/moe/fused_moe_quantized.h"
#include "kernels/moe/fused_moe_quantized_kernel.cuh"
#include "quantized_test_weights.h"
#include "tensor_values.h"

namespace kvserve {
namespace {

using cuda::QuantFormat;

constexpr int kWarps = 4;  // the launcher's block: 4 warps, an output each

template <typename P>  // the scales' and zeros' dtype: float or __half
struct Experts {
  std::vector<at::Tensor> q, scales, zeros;
  std::vector<const uint8_t*> q_ptr;
  std::vector<const P*> scale_ptr, zero_ptr;
};

// num_experts quantized [rows, k] weights of format F, group g, with zeros when asked.
template <QuantFormat F, typename P>
Experts<P> experts(int64_t num_experts, int64_t rows, int64_t k, int64_t g, bool zeros) {
  constexpr at::ScalarType kParams = std::is_same_v<P, float> ? at::kFloat : at::kHalf;
  Experts<P> e;
  for (int64_t x = 0; x < num_experts; ++x) {
    e.q.push_back(test_util::random_packed<F>(rows, k));
    // Dequantized weights of about unit variance over sqrt(k), as a trained layer's: outputs
    // of order one, where a bf16 rounding of the activations is within tolerance.
    const double spread = F == QuantFormat::kInt8 ? 64.0 : F == QuantFormat::kInt4 ? 4.0 : 8.0;
    e.scales.push_back(at::rand({rows, k / g})
                           .mul(0.5)
                           .add(0.75)
                           .div(spread * std::sqrt(double(k)))
                           .to(kParams));
    if (zeros) e.zeros.push_back(at::rand({rows, k / g}).mul(8).to(kParams));
    e.q_ptr.push_back(static_cast<const uint8_t*>(e.q.back().data_ptr()));
    e.scale_ptr.push_back(static_cast<const P*>(e.scales.back().data_ptr()));
    e.zero_ptr.push_back(zeros ? static_cast<const P*>(e.zeros.back().data_ptr()) : nullptr);
  }
  return e;
}

// P13 / P2: each projection's scales' dtype (float or __half); gated: SwiGLU, else relu2.
template <typename T, QuantFormat F, typename P13 = float, typename P2 = float>
void run_case(at::ScalarType dtype, int64_t hidden_size, int64_t inter, int64_t group,
              bool zeros, bool vector, double tolerance, bool gated = true) {
  SCOPED_TRACE(std::string(gated ? "silu " : "relu2 ") + c10::toString(dtype) + " format " +
               std::to_string(static_cast<int>(F)) + " hidden " + std::to_string(hidden_size) +
               " inter " + std::to_string(inter) + " group " + std::to_string(group) +
               (zeros ? " zeros" : "") + (vector ? " vectors" : " words") +
               (std::is_same_v<P13, float> ? "" : " fp16 w13 scales") +
               (std::is_same_v<P2, float> ? "" : " fp16 w2 scales"));
  at::manual_seed(7);
  const int64_t num_tokens = 3, k = 2, num_experts = 3;
  const Experts<P13> w13 =
      experts<F, P13>(num_experts, (gated ? 2 : 1) * inter, hidden_size, group, zeros);
  const char* activation = gated ? "silu" : "relu2";
  const Experts<P2> w2 = experts<F, P2>(num_experts, hidden_size, inter, group, zeros);
  // Rows one element apart from 16 bytes when the words path is tested.
  const at::Tensor wide = at::randn({num_tokens, hidden_size + 1}).to(dtype);
  const at::Tensor hidden = vector ? wide.narrow(1, 0, hidden_size).contiguous()
                                   : wide.narrow(1, 1, hidden_size);
  at::Tensor ids = at::empty({num_tokens, k}, at::kLong);
  const std::vector<int64_t> id_values = {0, 2, 1, 1, 2, 0};
  std::copy(id_values.begin(), id_values.end(), ids.data_ptr<int64_t>());
  const at::Tensor weights = at::rand({num_tokens, k});
  const at::Tensor expected =
      ops::fused_moe_quantized(hidden, w13.q, w13.scales, w13.zeros, group, w2.q, w2.scales,
                               w2.zeros, group, weights, ids, activation);
  // One more id, outside the table, in a copy run by the kernels alone: it adds nothing.
  at::Tensor bad_ids = ids.clone();
  bad_ids.data_ptr<int64_t>()[1] = num_experts;
  at::Tensor bad_weights = weights.clone();
  for (const bool bad : {false, true}) {
    SCOPED_TRACE(bad ? "a bad id" : "good ids");
    const at::Tensor& used = bad ? bad_ids : ids;
    at::Tensor act = at::empty({num_tokens * k, inter}, at::kFloat);
    at::Tensor out = at::empty({num_tokens, hidden_size}, dtype);
    emu::launch(cuda::moe_quantized_gate_up_kernel<T, F, P13>,
                dim3(num_tokens * k, static_cast<unsigned int>((inter + kWarps - 1) / kWarps)),
                dim3(32 * kWarps), 0, static_cast<const T*>(hidden.data_ptr()), hidden.stride(0),
                w13.q_ptr.data(), w13.scale_ptr.data(), w13.zero_ptr.data(), true, vector,
                used.data_ptr<int64_t>(), k, num_experts, hidden_size, inter, group, gated,
                act.data_ptr<float>());
    emu::launch(cuda::moe_quantized_down_combine_kernel<T, F, P2>,
                dim3(num_tokens, static_cast<unsigned int>((hidden_size + kWarps - 1) / kWarps)),
                dim3(32 * kWarps), 0, static_cast<const float*>(act.data_ptr<float>()),
                w2.q_ptr.data(), w2.scale_ptr.data(), w2.zero_ptr.data(), true, vector,
                used.data_ptr<int64_t>(), static_cast<const float*>(weights.data_ptr<float>()),
                k, num_experts, hidden_size, inter, group, static_cast<T*>(out.data_ptr()));
    if (!bad) {
      EXPECT_LE(test_util::worst_relative_error(expected, out), tolerance);
    } else {
      // Token 0 without its second expert: the CPU op with that slot's weight at 0.
      bad_weights.data_ptr<float>()[1] = 0.0f;
      const at::Tensor without =
          ops::fused_moe_quantized(hidden, w13.q, w13.scales, w13.zeros, group, w2.q,
                                   w2.scales, w2.zeros, group, bad_weights, ids, activation);
      EXPECT_LE(test_util::worst_relative_error(without, out), tolerance);
    }
  }
}

// Every format by vectors; by words (the path that ran on a GPU first) in one case a dtype.
template <typename T>
void run_all(at::ScalarType dtype, double tolerance) {
  run_case<T, QuantFormat::kInt8>(dtype, 64, 48, 16, false, true, tolerance);
  run_case<T, QuantFormat::kInt4>(dtype, 128, 96, 32, true, true, tolerance);
  run_case<T, QuantFormat::kFp8E4M3>(dtype, 48, 80, 16, false, true, tolerance);
  run_case<T, QuantFormat::kInt4>(dtype, 64, 32, 32, true, false, tolerance);
  // fp16 scales and zeros, in one projection or both
  run_case<T, QuantFormat::kInt4, __half, float>(dtype, 128, 96, 32, true, true, tolerance);
  run_case<T, QuantFormat::kInt8, float, __half>(dtype, 64, 48, 16, false, true, tolerance);
  run_case<T, QuantFormat::kInt4, __half, __half>(dtype, 64, 32, 32, true, false, tolerance);
  // experts without a gate
  run_case<T, QuantFormat::kInt8>(dtype, 64, 48, 16, false, true, tolerance, false);
  run_case<T, QuantFormat::kInt4, __half, float>(dtype, 64, 32, 32, true, false, tolerance,
                                                 false);
}

TEST(FusedMoeQuantizedEmulated, MatchesTheCpuOpByVectorsAndWords) {
  run_all<float>(at::kFloat, 2e-5);
  run_all<__nv_bfloat16>(at::kBFloat16, 2e-2);
  run_all<__half>(at::kHalf, 3e-3);
}

}  // namespace
}  // namespace kvserve
