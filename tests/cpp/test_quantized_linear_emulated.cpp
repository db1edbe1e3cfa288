// quantized_linear's CUDA bodies run by the CUDA emulator (cuda_emulator.h) with the launcher's
// launch shapes, against the CPU op: the 16-byte-vector GEMV for 1-8 tokens and the vector
// dequantization (int8, int4 with and without zeros, fp8 E4M3; per-row and grouped scales;
// bias or none; each input dtype), and the word-wise kernels they stand beside, which the
// vector ones must equal (the dequantization bit for bit).
#include "cuda_emulator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/rand.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "kernels/linear/quantized_linear.h"
#include "kernels/linear/quantized_linear_kernel.cuh"
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

template <QuantFormat F>
Weight random_weight(int64_t n, int64_t k, int64_t group_size, bool zeros) {
  Weight w;
  w.q = test_util::random_packed<F>(n, k);
  w.scales = at::rand({n, k / group_size}).mul(0.02).add(0.005);
  if (zeros) w.zeros = at::rand({n, k / group_size}).mul(8);
  w.group_size = group_size;
  return w;
}

// out [m, n] from the vector GEMV compiled for P >= m tokens.
template <typename T, QuantFormat F, int P>
at::Tensor vector_gemv(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& b) {
  const int64_t n = w.q.size(0), k = x.size(1);
  EXPECT_TRUE((cuda::vector_gemv_applies<F>(w.q.data_ptr(), x.data_ptr(),
                                             x.stride(0) * x.element_size(), k, w.group_size)));
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  auto launch = [&](auto kernel) {
    emu::launch(kernel, dim3(cuda::blocks_for_rows(n)), dim3(cuda::kQuantizedGemvThreads), 0,
                static_cast<const T*>(x.data_ptr()), x.stride(0), static_cast<int>(x.size(0)),
                static_cast<const uint8_t*>(w.q.data_ptr()), w.scales.data_ptr<float>(),
                w.zeros ? w.zeros->data_ptr<float>() : nullptr,
                b ? static_cast<const T*>(b->data_ptr()) : nullptr,
                static_cast<T*>(out.data_ptr()), n, k, w.group_size);
  };
  if (w.zeros) {
    launch(cuda::quantized_gemv_vector_kernel<T, F, P, true>);
  } else {
    launch(cuda::quantized_gemv_vector_kernel<T, F, P, false>);
  }
  return out;
}

// dequant(q) [n, k] in T from the vector kernel (vector = true) or the word-wise one.
template <typename T, QuantFormat F>
at::Tensor dequantized(const Weight& w, int64_t k, at::ScalarType dtype, bool vector) {
  const int64_t n = w.q.size(0);
  at::Tensor dst = at::empty({n, k}, dtype);
  const auto* q = static_cast<const uint8_t*>(w.q.data_ptr());
  const float* zeros = w.zeros ? w.zeros->data_ptr<float>() : nullptr;
  if (vector) {
    const int64_t vectors = k / cuda::kVectorInputs<F>;
    emu::launch(cuda::quantized_dequantize_vector_kernel<T, F>,
                dim3(n, static_cast<unsigned int>((vectors + 63) / 64)), dim3(64), 0, q,
                w.scales.data_ptr<float>(), zeros, static_cast<T*>(dst.data_ptr()), int64_t{0},
                k, w.group_size);
  } else {
    const int64_t words = cuda::quantized_row_bytes<F>(k) / 4;
    emu::launch(cuda::quantized_dequantize_kernel<T, F>,
                dim3(n, static_cast<unsigned int>((words + 63) / 64)), dim3(64), 0, q,
                w.scales.data_ptr<float>(), zeros, static_cast<T*>(dst.data_ptr()), int64_t{0},
                k, w.group_size, true);
  }
  return dst;
}

template <typename T, QuantFormat F>
void run_case(at::ScalarType dtype, int64_t n, int64_t k, int64_t group_size, bool zeros,
              bool bias, double tolerance) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " format " +
               std::to_string(static_cast<int>(F)) + " n " + std::to_string(n) + " k " +
               std::to_string(k) + " group " + std::to_string(group_size) +
               (zeros ? " zeros" : "") + (bias ? " bias" : ""));
  at::manual_seed(11);
  const Weight w = random_weight<F>(n, k, group_size, zeros);
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
}

TEST(QuantizedLinearEmulated, VectorKernelsMatchTheCpuOpInEveryDtype) {
  run_all<float>(at::kFloat, 2e-5);
  run_all<__nv_bfloat16>(at::kBFloat16, 2e-2);
  run_all<__half>(at::kHalf, 3e-3);
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
