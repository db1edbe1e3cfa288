// rotary_embedding's CUDA bodies run by the CUDA emulator (cuda_emulator.h) with the launcher's
// launch shapes, against the CPU op: the plain kernel, and the normed one (an RMSNorm of each
// head first: Qwen3's and Gemma 3's q_norm / k_norm) over awkward head sizes, partial rotary,
// both pair layouts, either side normalized, model-dtype and fp32 weights, each dtype; the
// kernels under two warp schedules and several blocks per token, which must agree bit for bit.
#include "cuda_emulator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/rotary/rotary_embedding.h"
#include "kernels/rotary/rotary_embedding_kernel.cuh"
#include "tensor_values.h"

namespace kvserve {
namespace {

constexpr int64_t kMaxPosition = 64;

// fp32 [kMaxPosition, rot_dim]: Llama's angles, cosines then sines.
at::Tensor cos_sin_cache(int64_t rot_dim) {
  at::Tensor cache = at::empty({kMaxPosition, rot_dim}, at::kFloat);
  float* out = cache.data_ptr<float>();
  for (int64_t p = 0; p < kMaxPosition; ++p) {
    for (int64_t i = 0; i < rot_dim / 2; ++i) {
      const double angle = p * std::pow(10000.0, -2.0 * i / static_cast<double>(rot_dim));
      out[p * rot_dim + i] = static_cast<float>(std::cos(angle));
      out[p * rot_dim + rot_dim / 2 + i] = static_cast<float>(std::sin(angle));
    }
  }
  return cache;
}

// Norm weights around 1.
at::Tensor norm_weight(int64_t head_dim, at::ScalarType dtype) {
  at::Tensor w = at::randn({head_dim});
  float* v = w.data_ptr<float>();
  for (int64_t i = 0; i < head_dim; ++i) v[i] = 1.0f + 0.5f * v[i];
  return w.to(dtype);
}

struct Case {
  int64_t heads, kv_heads, head_dim, rot_dim;
  bool is_neox;
  const char* sides;  // "" (the plain kernel), "qk", "q" or "k"
  bool fp32_weights;
};

template <typename T>
void run_case(at::ScalarType dtype, const Case& c, double tolerance) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " heads " + std::to_string(c.heads) + "/" +
               std::to_string(c.kv_heads) + " head_dim " + std::to_string(c.head_dim) +
               " rot " + std::to_string(c.rot_dim) + (c.is_neox ? " neox" : " interleaved") +
               " norms '" + c.sides + "'" + (c.fp32_weights ? " fp32" : ""));
  at::manual_seed(5);
  const int64_t tokens = 5, q_width = c.heads * c.head_dim, k_width = c.kv_heads * c.head_dim;
  // A fused qkv: q and k are strided views of it, v must be left alone.
  const at::Tensor qkv = at::randn({tokens, q_width + 2 * k_width}).to(dtype);
  at::Tensor positions = at::empty({tokens}, at::kLong);
  for (int64_t t = 0; t < tokens; ++t) positions.data_ptr<int64_t>()[t] = t * 13 % kMaxPosition;
  const at::Tensor cache = cos_sin_cache(c.rot_dim);
  const at::ScalarType weight_type = c.fp32_weights ? at::kFloat : dtype;
  std::optional<at::Tensor> q_norm, k_norm;
  const std::string sides = c.sides;
  if (sides.find('q') != std::string::npos) {
    q_norm = norm_weight(c.head_dim, weight_type);
  }
  if (sides.find('k') != std::string::npos) {
    k_norm = norm_weight(c.head_dim, weight_type);
  }
  at::Tensor expected = qkv.clone();
  at::Tensor eq = expected.narrow(1, 0, q_width), ek = expected.narrow(1, q_width, k_width);
  ops::rotary_embedding(positions, eq, ek, c.head_dim, cache, c.is_neox, q_norm, k_norm, 1e-6);

  // The launcher's blocks per token, then one and three (each must give the same bits).
  const int normed_threads = cuda::rotary_normed_threads(c.heads + c.kv_heads);
  const unsigned int launcher_splits =
      sides.empty() ? cuda::rotary_splits(tokens, (c.heads + c.kv_heads) * (c.rot_dim / 2),
                                          cuda::kRotaryThreads)
                    : cuda::rotary_splits(tokens, c.heads + c.kv_heads, normed_threads / 32);
  at::Tensor first;
  for (const auto& [schedule, splits] :
       {std::pair{emu::Schedule::kInterleaved, launcher_splits},
        std::pair{emu::Schedule::kWarpsAheadReversed, launcher_splits},
        std::pair{emu::Schedule::kInterleaved, 1u}, std::pair{emu::Schedule::kInterleaved, 3u}}) {
    SCOPED_TRACE("blocks per token " + std::to_string(splits));
    emu::set_schedule(schedule);
    at::Tensor actual = qkv.clone();
    T* q = static_cast<T*>(actual.data_ptr());
    T* k = q + q_width;
    const int64_t stride = actual.stride(0);
    if (sides.empty()) {
      emu::launch(cuda::rotary_embedding_kernel<T>, dim3(tokens, splits),
                  dim3(cuda::kRotaryThreads), 0,
                  positions.data_ptr<int64_t>(), q, stride, c.heads, k, stride, c.kv_heads,
                  c.head_dim, cache.data_ptr<float>(), c.rot_dim, kMaxPosition, c.is_neox);
    } else {
      auto launch = [&](auto* weight_type_tag) {
        using W = std::remove_pointer_t<decltype(weight_type_tag)>;
        auto weight = [](const std::optional<at::Tensor>& w) {
          return w ? static_cast<const W*>(w->data_ptr()) : nullptr;
        };
        emu::launch(cuda::rotary_embedding_normed_kernel<T, W>, dim3(tokens, splits),
                    dim3(normed_threads), 0,
                    positions.data_ptr<int64_t>(), q, stride, c.heads, k, stride, c.kv_heads,
                    c.head_dim, cache.data_ptr<float>(), c.rot_dim, kMaxPosition, c.is_neox,
                    weight(q_norm), weight(k_norm), 1e-6f);
      };
      if (c.fp32_weights) {
        launch(static_cast<float*>(nullptr));
      } else {
        launch(static_cast<T*>(nullptr));
      }
    }
    EXPECT_LE(test_util::worst_relative_error(expected, actual), tolerance);
    // v's columns exactly as they were.
    EXPECT_TRUE(actual.narrow(1, q_width + k_width, k_width)
                    .equal(qkv.narrow(1, q_width + k_width, k_width)));
    if (!first.defined()) {
      first = actual;
    } else {
      EXPECT_TRUE(first.equal(actual)) << "the warp schedules or block splits disagree";
    }
  }
  emu::set_schedule(emu::Schedule::kInterleaved);
}

template <typename T>
void run_all(at::ScalarType dtype, double tolerance) {
  for (const Case& c : {Case{4, 2, 64, 64, true, "", false}, Case{4, 2, 80, 20, false, "", false},
                        Case{4, 2, 128, 128, true, "qk", false},
                        Case{16, 8, 128, 128, true, "qk", true},  // more heads than warps
                        Case{2, 1, 80, 80, false, "qk", false},
                        Case{3, 1, 96, 32, true, "qk", true},     // partial rotary
                        Case{2, 2, 24, 24, true, "q", false},
                        Case{2, 2, 256, 256, false, "k", false},
                        Case{5, 0, 40, 40, true, "q", false}}) {  // no key (a shared-KV layer)
    run_case<T>(dtype, c, tolerance);
  }
}

TEST(RotaryEmbeddingEmulated, MatchesTheCpuOpInEveryDtype) {
  run_all<float>(at::kFloat, 2e-6);
  run_all<__nv_bfloat16>(at::kBFloat16, 1e-2);
  run_all<__half>(at::kHalf, 2e-3);
}

}  // namespace
}  // namespace kvserve
