// quantized_linear's CUDA bodies run by the CUDA emulator (cuda_emulator.h) with the launcher's
// launch shapes, against the CPU op: the 16-byte-vector GEMV for 1-8 tokens, the tensor-core
// GEMM for any number of tokens (bf16 / fp16) and the vector dequantization (int8, int4 with
// and without zeros, fp8 E4M3; per-row and grouped scales, fp32 or fp16; bias or none; each
// input dtype), and
// the word-wise kernels they stand beside, which the vector ones must equal (the dequantization
// bit for bit); and the wide tensor-core GEMM with its k-blocks split among blocks, in each block
// order and schedule.
#include <ATen/ops/empty.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "cuda_emulator.h"
#include "kernels/linear/quantized_linear.h"
#include "kernels/linear/quantized_linear_kernel.cuh"
#include "kernels/linear/quantized_linear_mma_kernel.cuh"
#include "kernels/linear/quantized_linear_wide_kernel.cuh"
#include "quantized_test_weights.h"
#include "tensor_values.h"

namespace kvserve {
namespace {

using cuda::QuantFormat;

struct Weight {
  at::Tensor q, scales;
  std::optional<at::Tensor> zeros;
  int64_t group_size;
};

// half: scales and zeros in fp16.
template <QuantFormat F>
Weight random_weight(int64_t n, int64_t k, int64_t group_size, bool zeros, bool half = false) {
  Weight w;
  w.q = test_util::random_packed<F>(n, k);
  w.scales = at::rand({n, k / group_size}).mul(0.02).add(0.005);
  if (zeros) w.zeros = at::rand({n, k / group_size}).mul(8);
  if (half) {
    w.scales = w.scales.to(at::kHalf);
    if (zeros) w.zeros = w.zeros->to(at::kHalf);
  }
  w.group_size = group_size;
  return w;
}

// Calls f(scales, zeros) with w's scales and zeros (null: none) as the kernels take them:
// const float*, or const __half* for fp16 ones.
template <typename Fn>
void with_params(const Weight& w, Fn&& f) {
  if (w.scales.scalar_type() == at::kHalf) {
    f(static_cast<const __half*>(w.scales.data_ptr()),
      w.zeros ? static_cast<const __half*>(w.zeros->data_ptr()) : nullptr);
  } else {
    f(w.scales.data_ptr<float>(), w.zeros ? w.zeros->data_ptr<float>() : nullptr);
  }
}

template <typename Pointer>
using Param = std::remove_cv_t<std::remove_pointer_t<Pointer>>;

// out [m, n] from the vector GEMV compiled for P >= m tokens.
template <typename T, QuantFormat F, int P>
at::Tensor vector_gemv(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& b) {
  const int64_t n = w.q.size(0), k = x.size(1);
  EXPECT_TRUE((cuda::vector_gemv_applies<F>(w.q.data_ptr(), x.data_ptr(),
                                             x.stride(0) * x.element_size(), k, w.group_size)));
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  with_params(w, [&](auto scales, auto zeros) {
    auto launch = [&](auto kernel) {
      emu::launch(kernel, dim3(cuda::blocks_for_rows(n)), dim3(cuda::kQuantizedGemvThreads), 0,
                  static_cast<const T*>(x.data_ptr()), x.stride(0), static_cast<int>(x.size(0)),
                  static_cast<const uint8_t*>(w.q.data_ptr()), scales, zeros,
                  b ? static_cast<const T*>(b->data_ptr()) : nullptr,
                  static_cast<T*>(out.data_ptr()), n, k, w.group_size);
    };
    using Q = Param<decltype(scales)>;
    if (w.zeros) {
      launch(cuda::quantized_gemv_vector_kernel<T, F, P, true, Q>);
    } else {
      launch(cuda::quantized_gemv_vector_kernel<T, F, P, false, Q>);
    }
  });
  return out;
}

// dequant(q) [n, k] in T from the vector kernel (vector = true) or the word-wise one.
template <typename T, QuantFormat F>
at::Tensor dequantized(const Weight& w, int64_t k, at::ScalarType dtype, bool vector) {
  const int64_t n = w.q.size(0);
  at::Tensor dst = at::empty({n, k}, dtype);
  const auto* q = static_cast<const uint8_t*>(w.q.data_ptr());
  with_params(w, [&](auto scales, auto zeros) {
    using Q = Param<decltype(scales)>;
    if (vector) {
      const int64_t vectors = k / cuda::kVectorInputs<F>;
      emu::launch(cuda::quantized_dequantize_vector_kernel<T, F, Q>,
                  dim3(n, static_cast<unsigned int>((vectors + 63) / 64)), dim3(64), 0, q, scales,
                  zeros, static_cast<T*>(dst.data_ptr()), int64_t{0}, k, w.group_size);
    } else {
      const int64_t words = cuda::quantized_row_bytes<F>(k) / 4;
      emu::launch(cuda::quantized_dequantize_kernel<T, F, Q>,
                  dim3(n, static_cast<unsigned int>((words + 63) / 64)), dim3(64), 0, q, scales,
                  zeros, static_cast<T*>(dst.data_ptr()), int64_t{0}, k, w.group_size, true);
    }
  });
  return dst;
}

template <typename T, QuantFormat F>
void run_case(at::ScalarType dtype, int64_t n, int64_t k, int64_t group_size, bool zeros,
              bool bias, double tolerance, bool half = false) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " format " +
               std::to_string(static_cast<int>(F)) + " n " + std::to_string(n) + " k " +
               std::to_string(k) + " group " + std::to_string(group_size) +
               (zeros ? " zeros" : "") + (bias ? " bias" : "") + (half ? " fp16 scales" : ""));
  at::manual_seed(11);
  const Weight w = random_weight<F>(n, k, group_size, zeros, half);
  const std::optional<at::Tensor> b =
      bias ? std::optional<at::Tensor>(at::randn({n}).to(dtype)) : std::nullopt;
  // Rows 16 bytes apart but strided: a view of a wider input.
  const int64_t pad = 16 / at::elementSize(dtype);
  const at::Tensor wide = at::randn({8, k + pad}).to(dtype);
  for (const int64_t m : {1, 2, 3, 8}) {
    SCOPED_TRACE("tokens " + std::to_string(m));
    const at::Tensor x = wide.narrow(0, 0, m).narrow(1, 0, k);
    const at::Tensor expected = ops::quantized_linear(x, w.q, w.scales, w.zeros, group_size, b);
    at::Tensor actual;
    if (m == 1) {
      actual = vector_gemv<T, F, 1>(x, w, b);
    } else if (m == 2) {
      actual = vector_gemv<T, F, 2>(x, w, b);
    } else if (m <= 4) {
      actual = vector_gemv<T, F, 4>(x, w, b);
    } else {
      actual = vector_gemv<T, F, 8>(x, w, b);
    }
    EXPECT_LE(test_util::worst_relative_error(expected, actual), tolerance);
    if (m == 3) {  // more tokens compiled for than run: the same values
      EXPECT_TRUE((vector_gemv<T, F, 8>(x, w, b).equal(actual)));
    }
  }
  const at::Tensor vector = dequantized<T, F>(w, k, dtype, true);
  EXPECT_TRUE(vector.equal(dequantized<T, F>(w, k, dtype, false)));
}

template <typename T>
void run_all(at::ScalarType dtype, double tolerance) {
  // (n, k, group): rows that fill no block of 8, per-row and grouped scales.
  run_case<T, QuantFormat::kInt8>(dtype, 13, 96, 96, false, true, tolerance);
  run_case<T, QuantFormat::kInt8>(dtype, 8, 1040, 16, false, false, tolerance);
  run_case<T, QuantFormat::kInt8>(dtype, 3, 64, 32, true, false, tolerance);
  run_case<T, QuantFormat::kInt4>(dtype, 9, 128, 64, true, true, tolerance);
  run_case<T, QuantFormat::kInt4>(dtype, 5, 1056, 32, false, false, tolerance);
  run_case<T, QuantFormat::kInt4>(dtype, 17, 160, 160, true, false, tolerance);
  run_case<T, QuantFormat::kFp8E4M3>(dtype, 11, 48, 48, false, true, tolerance);
  run_case<T, QuantFormat::kFp8E4M3>(dtype, 2, 2064, 2064, false, false, tolerance);
  // fp16 scales and zeros (AWQ's, GPTQ's, GGUF's)
  run_case<T, QuantFormat::kInt8>(dtype, 8, 1040, 16, false, true, tolerance, true);
  run_case<T, QuantFormat::kInt4>(dtype, 9, 128, 64, true, true, tolerance, true);
  run_case<T, QuantFormat::kInt4>(dtype, 17, 160, 160, true, false, tolerance, true);
  run_case<T, QuantFormat::kFp8E4M3>(dtype, 11, 48, 48, false, true, tolerance, true);
}

TEST(QuantizedLinearEmulated, VectorKernelsMatchTheCpuOpInEveryDtype) {
  run_all<float>(at::kFloat, 2e-5);
  run_all<__nv_bfloat16>(at::kBFloat16, 2e-2);
  run_all<__half>(at::kHalf, 3e-3);
}

// out [m, n] from the tensor-core GEMM compiled for `tiles` token tiles (enough or more).
template <typename T, QuantFormat F>
at::Tensor mma_gemm(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& b,
                    int tiles) {
  const int64_t n = w.q.size(0), k = x.size(1), m = x.size(0);
  EXPECT_TRUE((cuda::vector_gemv_applies<F>(w.q.data_ptr(), x.data_ptr(),
                                            x.stride(0) * x.element_size(), k, w.group_size)));
  at::Tensor out = at::empty({m, n}, x.options());
  auto with_tiles = [&](auto tiles_constant) {
    constexpr int kTiles = decltype(tiles_constant)::value;
    with_params(w, [&](auto scales, auto zeros) {
      auto launch = [&](auto kernel) {
        emu::launch(kernel, dim3(static_cast<unsigned int>(cuda::mma_gemm_blocks(m, n, kTiles))),
                    dim3(cuda::kMmaGemmThreads), cuda::mma_gemm_shared_bytes(kTiles),
                    static_cast<const T*>(x.data_ptr()), x.stride(0), m,
                    static_cast<const uint8_t*>(w.q.data_ptr()), scales, zeros,
                    b ? static_cast<const T*>(b->data_ptr()) : nullptr,
                    static_cast<T*>(out.data_ptr()), n, k, w.group_size);
      };
      using Q = Param<decltype(scales)>;
      if (w.zeros) {
        launch(cuda::quantized_gemm_mma_kernel<T, F, kTiles, true, Q>);
      } else {
        launch(cuda::quantized_gemm_mma_kernel<T, F, kTiles, false, Q>);
      }
    });
  };
  if (tiles == 1) {
    with_tiles(std::integral_constant<int, 1>{});
  } else if (tiles == 2) {
    with_tiles(std::integral_constant<int, 2>{});
  } else if (tiles == 4) {
    with_tiles(std::integral_constant<int, 4>{});
  } else {
    with_tiles(std::integral_constant<int, 8>{});
  }
  return out;
}

template <typename T, QuantFormat F>
void run_mma_case(at::ScalarType dtype, int64_t n, int64_t k, int64_t group_size, bool zeros,
                  bool bias, std::initializer_list<int64_t> tokens, double tolerance,
                  bool half = false) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " format " +
               std::to_string(static_cast<int>(F)) + " n " + std::to_string(n) + " k " +
               std::to_string(k) + " group " + std::to_string(group_size) +
               (zeros ? " zeros" : "") + (bias ? " bias" : "") + (half ? " fp16 scales" : ""));
  at::manual_seed(13);
  const Weight w = random_weight<F>(n, k, group_size, zeros, half);
  const std::optional<at::Tensor> b =
      bias ? std::optional<at::Tensor>(at::randn({n}).to(dtype)) : std::nullopt;
  const int64_t pad = 16 / at::elementSize(dtype);  // rows 16 bytes apart, strided
  const int64_t most = std::max(tokens);
  const at::Tensor wide = at::randn({most, k + pad}).to(dtype);
  // The weights the kernel multiplies: dequantized to T exactly as the dequantizing path does.
  const at::Tensor weight = dequantized<T, F>(w, k, dtype, true).to(at::kFloat);
  for (const int64_t m : tokens) {
    SCOPED_TRACE("tokens " + std::to_string(m));
    const at::Tensor x = wide.narrow(0, 0, m).narrow(1, 0, k);
    const int tiles = cuda::mma_gemm_tiles(m);
    const at::Tensor actual = mma_gemm<T, F>(x, w, b, tiles);
    // Against the CPU op, whose weights stay fp32: a norm-wise bound, as rounding the weights
    // to T moves each output by up to ~sqrt(k) weight roundings.
    const at::Tensor expected = ops::quantized_linear(x, w.q, w.scales, w.zeros, group_size, b);
    EXPECT_LE(actual.to(at::kFloat).sub(expected.to(at::kFloat)).norm().item<double>(),
              tolerance * expected.to(at::kFloat).norm().item<double>());
    // Against fp32 sums of the same T weights: only the order of the sums and the output's
    // rounding differ.
    at::Tensor sums = x.to(at::kFloat).matmul(weight.t());
    if (b) sums = sums.add(b->to(at::kFloat));
    EXPECT_LE(test_util::worst_relative_error(sums.to(dtype), actual),
              dtype == at::kBFloat16 ? 8e-3 : 1e-3);
    if (tiles < cuda::kMmaGemmMaxTiles) {  // more token tiles compiled for: the same values
      EXPECT_TRUE((mma_gemm<T, F>(x, w, b, cuda::kMmaGemmMaxTiles).equal(actual)));
    }
  }
}

// (n, k, group): rows that fill no 16-row block; inputs that leave warps idle, that end inside
// a warp's block of 4 vectors, and that wrap the 4-stage pipeline (40 blocks: 5 for each of the
// 8 warps); token counts in one tile, in part of one, and in several blocks.
template <typename T>
void run_mma_all(at::ScalarType dtype, double tolerance) {
  run_mma_case<T, QuantFormat::kInt8>(dtype, 13, 96, 96, false, true, {1, 3, 8, 9}, tolerance);
  run_mma_case<T, QuantFormat::kInt8>(dtype, 17, 2560, 32, true, false, {5, 17}, tolerance);
  run_mma_case<T, QuantFormat::kInt4>(dtype, 9, 160, 32, true, true, {2, 33}, tolerance);
  run_mma_case<T, QuantFormat::kInt4>(dtype, 16, 5120, 128, false, false, {4}, tolerance);
  run_mma_case<T, QuantFormat::kInt4>(dtype, 20, 1024, 256, true, true, {3, 40}, tolerance);
  run_mma_case<T, QuantFormat::kInt8>(dtype, 140, 1024, 1024, false, true, {3}, tolerance);
  run_mma_case<T, QuantFormat::kFp8E4M3>(dtype, 20, 48, 48, false, true, {70}, tolerance);
  run_mma_case<T, QuantFormat::kInt4>(dtype, 9, 160, 32, true, true, {2, 33}, tolerance, true);
  run_mma_case<T, QuantFormat::kInt8>(dtype, 17, 2560, 32, false, false, {5}, tolerance, true);
}

TEST(QuantizedLinearEmulated, TensorCoreKernelMatchesTheCpuOp) {
  run_mma_all<__nv_bfloat16>(at::kBFloat16, 1e-2);
  run_mma_all<__half>(at::kHalf, 2e-3);
}

// out [m, n] from the wide tensor-core GEMM, its k-blocks split among `splits` blocks per tile;
// the counters must be left at zero.
template <typename T, QuantFormat F>
at::Tensor wide_gemm(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& b,
                     int splits) {
  const int64_t n = w.q.size(0), k = x.size(1), m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  auto with_tiles = [&](auto tiles_constant) {
    constexpr int kTiles = decltype(tiles_constant)::value;
    const int64_t tiles = cuda::wide_gemm_tiles(m, n, kTiles);
    at::Tensor partials = at::empty({splits, m, n}, at::kFloat);
    at::Tensor counters = at::zeros({tiles}, at::kInt);
    with_params(w, [&](auto scales, auto zeros) {
      auto launch = [&](auto kernel) {
        emu::launch(kernel, dim3(static_cast<unsigned int>(tiles * splits)),
                    dim3(cuda::kWideGemmThreads), cuda::wide_gemm_shared_bytes<F>(kTiles),
                    static_cast<const T*>(x.data_ptr()), x.stride(0), m,
                    static_cast<const uint8_t*>(w.q.data_ptr()), scales, zeros,
                    b ? static_cast<const T*>(b->data_ptr()) : nullptr,
                    static_cast<T*>(out.data_ptr()), n, k, w.group_size, splits,
                    partials.data_ptr<float>(), counters.data_ptr<int>());
      };
      using Q = Param<decltype(scales)>;
      if (w.zeros) {
        launch(cuda::quantized_gemm_wide_kernel<T, F, kTiles, true, Q>);
      } else {
        launch(cuda::quantized_gemm_wide_kernel<T, F, kTiles, false, Q>);
      }
    });
    EXPECT_EQ(counters.count_nonzero().item<int64_t>(), 0);
  };
  switch (cuda::mma_gemm_tiles(m)) {
    case 1: with_tiles(std::integral_constant<int, 1>{}); break;
    case 2: with_tiles(std::integral_constant<int, 2>{}); break;
    case 4: with_tiles(std::integral_constant<int, 4>{}); break;
    default: with_tiles(std::integral_constant<int, 8>{}); break;
  }
  return out;
}

template <typename T, QuantFormat F>
void run_wide_case(at::ScalarType dtype, int64_t n, int64_t k, int64_t group_size, bool zeros,
                   bool bias, std::initializer_list<int64_t> tokens,
                   std::initializer_list<int> splits, double tolerance, bool half = false) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " format " +
               std::to_string(static_cast<int>(F)) + " n " + std::to_string(n) + " k " +
               std::to_string(k) + " group " + std::to_string(group_size) +
               (zeros ? " zeros" : "") + (bias ? " bias" : "") + (half ? " fp16 scales" : ""));
  at::manual_seed(17);
  const Weight w = random_weight<F>(n, k, group_size, zeros, half);
  const std::optional<at::Tensor> b =
      bias ? std::optional<at::Tensor>(at::randn({n}).to(dtype)) : std::nullopt;
  const int64_t pad = 16 / at::elementSize(dtype);  // rows 16 bytes apart, strided
  const at::Tensor wide = at::randn({std::max(tokens), k + pad}).to(dtype);
  const at::Tensor weight = dequantized<T, F>(w, k, dtype, true).to(at::kFloat);
  for (const int64_t m : tokens) {
    const at::Tensor x = wide.narrow(0, 0, m).narrow(1, 0, k);
    const at::Tensor expected = ops::quantized_linear(x, w.q, w.scales, w.zeros, group_size, b);
    at::Tensor sums = x.to(at::kFloat).matmul(weight.t());
    if (b) sums = sums.add(b->to(at::kFloat));
    for (const int split : splits) {
      SCOPED_TRACE("tokens " + std::to_string(m) + " splits " + std::to_string(split));
      // Blocks in index order, threads in turns, copies landing late; then the last block first
      // (another block adds the splits), one warp running ahead, copies landing at once.
      emu::set_block_order(emu::BlockOrder::kForward);
      const at::Tensor actual = wide_gemm<T, F>(x, w, b, split);
      emu::set_block_order(emu::BlockOrder::kReversed);
      emu::set_schedule(emu::Schedule::kWarpsAheadReversed);
      emu::set_copy_timing(emu::CopyTiming::kEarly);
      const at::Tensor again = wide_gemm<T, F>(x, w, b, split);
      emu::set_block_order(emu::BlockOrder::kForward);
      emu::set_schedule(emu::Schedule::kInterleaved);
      emu::set_copy_timing(emu::CopyTiming::kLate);
      EXPECT_TRUE(again.equal(actual));  // the splits add in one order, whoever adds them
      EXPECT_LE(actual.to(at::kFloat).sub(expected.to(at::kFloat)).norm().item<double>(),
                tolerance * expected.to(at::kFloat).norm().item<double>());
      EXPECT_LE(test_util::worst_relative_error(sums.to(dtype), actual),
                dtype == at::kBFloat16 ? 8e-3 : 1e-3);
    }
  }
}

// (n, k, group): rows that fill no block (128 rows up to 16 tokens, 256 beyond) or several;
// inputs that end inside a k-block (4 vectors) and inputs of one k-block; splits that divide the
// k-blocks unevenly; token counts in part of a tile, in one, in two blocks of 64.
template <typename T>
void run_wide_all(at::ScalarType dtype, double tolerance) {
  run_wide_case<T, QuantFormat::kInt8>(dtype, 13, 96, 96, false, true, {1, 8, 9}, {1, 2},
                                       tolerance);
  run_wide_case<T, QuantFormat::kInt8>(dtype, 300, 1040, 16, true, false, {5, 33, 70}, {1, 3},
                                       tolerance);
  run_wide_case<T, QuantFormat::kInt4>(dtype, 140, 1056, 32, true, true, {17, 64}, {1, 4},
                                       tolerance);
  run_wide_case<T, QuantFormat::kInt4>(dtype, 9, 160, 32, false, false, {2}, {1, 2}, tolerance);
  run_wide_case<T, QuantFormat::kFp8E4M3>(dtype, 20, 48, 48, false, true, {70}, {1}, tolerance);
  run_wide_case<T, QuantFormat::kInt4>(dtype, 33, 512, 128, true, true, {40}, {2}, tolerance,
                                       true);
}

TEST(QuantizedLinearEmulated, WideTensorCoreKernelMatchesTheCpuOpWithSplitInputs) {
  run_wide_all<__nv_bfloat16>(at::kBFloat16, 1e-2);
  run_wide_all<__half>(at::kHalf, 2e-3);
}

TEST(QuantizedLinearEmulated, WideKernelSplitsFillOneWave) {
  // 132 multiprocessors, one block each: a Llama-3-8B q/k/v projection (6144 rows, 4096 int8
  // inputs = 64 k-blocks) at 64 tokens makes 24 tiles of 256 rows, so 5 splits; at 16 tokens 48
  // tiles of 128 rows, 2 splits; gate_up (28672 rows) fills the GPU alone.
  EXPECT_EQ(cuda::wide_gemm_splits(cuda::wide_gemm_tiles(64, 6144, 8), 64, 132), 5);
  EXPECT_EQ(cuda::wide_gemm_splits(cuda::wide_gemm_tiles(16, 6144, 2), 64, 132), 2);
  EXPECT_EQ(cuda::wide_gemm_splits(cuda::wide_gemm_tiles(64, 28672, 8), 64, 132), 1);
  // Never shorter than the pipeline's depth twice over: 16 k-blocks split at most in 2.
  EXPECT_EQ(cuda::wide_gemm_splits(1, 16, 132), 2);
  EXPECT_EQ(cuda::wide_gemm_splits(1, 7, 132), 1);
  EXPECT_EQ(cuda::wide_gemm_k_blocks<QuantFormat::kInt4>(1056), 9);
  EXPECT_EQ(cuda::wide_gemm_k_blocks<QuantFormat::kInt8>(4096), 64);
}

TEST(QuantizedLinearEmulated, VectorPathNeedsAlignedData) {
  const at::Tensor q = at::empty({4, 64}, at::kChar);
  const at::Tensor x = at::empty({2, 80}, at::kBFloat16);
  const auto* base = static_cast<const uint8_t*>(q.data_ptr());
  EXPECT_TRUE((cuda::vector_gemv_applies<QuantFormat::kInt8>(base, x.data_ptr(), 160, 64, 64)));
  EXPECT_FALSE((cuda::vector_gemv_applies<QuantFormat::kInt8>(base + 4, x.data_ptr(), 160, 64,
                                                               64)));  // q off 16 bytes
  EXPECT_FALSE((cuda::vector_gemv_applies<QuantFormat::kInt8>(base, x.data_ptr(), 150, 64,
                                                               64)));  // input stride
  EXPECT_FALSE((cuda::vector_gemv_applies<QuantFormat::kInt8>(base, x.data_ptr(), 160, 72,
                                                               72)));  // k not whole vectors
  EXPECT_FALSE((cuda::vector_gemv_applies<QuantFormat::kInt8>(base, x.data_ptr(), 160, 64,
                                                               8)));  // groups of 8
  EXPECT_FALSE((cuda::vector_gemv_applies<QuantFormat::kInt4>(base, x.data_ptr(), 160, 64,
                                                               16)));  // int4: 32 a vector
}

}  // namespace
}  // namespace kvserve
