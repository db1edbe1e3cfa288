// CUDA launcher for llm_int8_linear: the shared checks, then the three passes of the body
// (per-token split and int8 rounding, the integer product, the scaled epilogue with the
// outliers' fp32 product). The integer product is the body's GEMV for a few tokens and cuBLAS's
// int8 GEMM (at::_int_mm) for more; both are exact, so a token's result does not depend on which
// one its batch took.
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda_launch.h"
#include "kernels/linear/llm_int8_linear.h"
#include "kernels/linear/llm_int8_linear_checks.h"
#include "kernels/linear/llm_int8_linear_kernel.cuh"

namespace kvserve::ops {
namespace {

// cuBLAS's int8 GEMM takes more than 16 rows and multiples of 8 for k and n; below that the
// GEMV reads each weight row once per kInt8GemvTokens tokens.
constexpr int64_t kInt8MaxGemvTokens = 16;
constexpr int kInt8GemvWarps = 4;
constexpr int kEpilogueThreads = 128;
constexpr int64_t kMaxGridY = 65535;

bool is_word_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

// acc [m, n] int32 = xq [m, k] @ weight [n, k]^T.
at::Tensor integer_product(const at::Tensor& xq, const at::Tensor& weight) {
  const int64_t m = xq.size(0), k = xq.size(1), n = weight.size(0);
  if (m > kInt8MaxGemvTokens && k > 0 && k % 8 == 0 && n % 8 == 0) return at::_int_mm(xq, weight.t());
  at::Tensor acc = at::empty({m, n}, xq.options().dtype(at::kInt));
  const dim3 grid(cuda::blocks_for(n, kInt8GemvWarps), cuda::blocks_for(m, cuda::kInt8GemvTokens));
  const bool aligned = k % 4 == 0 && is_word_aligned(xq.data_ptr()) &&
                       is_word_aligned(weight.data_ptr());
  cuda::int8_gemm_kernel<<<grid, 32 * kInt8GemvWarps, 0, cuda::current_stream()>>>(
      xq.data_ptr<int8_t>(), weight.data_ptr<int8_t>(), acc.data_ptr<int32_t>(), m, n, k,
      aligned);
  KVSERVE_CUDA_CHECK_LAUNCH();
  return acc;
}

at::Tensor llm_int8_linear_cuda(const at::Tensor& input, const at::Tensor& weight,
                                const at::Tensor& weight_scales, double threshold,
                                const std::optional<at::Tensor>& bias) {
  check_llm_int8_linear(input, weight, weight_scales, threshold, bias);
  const int64_t m = input.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor out = at::empty({m, n}, input.options());
  if (m == 0 || n == 0) return out;
  const c10::cuda::CUDAGuard guard(input.device());
  const auto options = input.options();
  // threshold <= 0 leaves no outliers (inf leaves only infinite entries, as on the CPU).
  const bool split = threshold > 0;
  at::Tensor xq = at::empty({m, k}, options.dtype(at::kChar));
  at::Tensor row_scale = at::empty({m}, options.dtype(at::kFloat));
  at::Tensor num_outliers, columns;  // per token: how many, and which (ascending)
  if (split) {
    num_outliers = at::empty({m}, options.dtype(at::kInt));
    columns = at::empty({m, k}, options.dtype(at::kInt));
  }
  const auto int32_or_null = [](const at::Tensor& t) {
    return t.defined() ? t.data_ptr<int32_t>() : nullptr;
  };
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  cuda::dispatch_float(input.scalar_type(), "llm_int8_linear", [&](auto type) {
    using T = typename decltype(type)::type;
    const auto* x = static_cast<const T*>(input.data_ptr());
    cuda::llm_int8_split_kernel<T><<<cuda::blocks_for(m, kInt8GemvWarps), 32 * kInt8GemvWarps, 0,
                                     cuda::current_stream()>>>(
        x, input.stride(0), m, k, split, static_cast<float>(threshold), xq.data_ptr<int8_t>(),
        row_scale.data_ptr<float>(), int32_or_null(num_outliers), int32_or_null(columns));
    KVSERVE_CUDA_CHECK_LAUNCH();
    const at::Tensor acc = integer_product(xq, weight);
    const dim3 grid(cuda::blocks_for(n, kEpilogueThreads), std::min(m, kMaxGridY));
    cuda::llm_int8_epilogue_kernel<T><<<grid, kEpilogueThreads, 0, cuda::current_stream()>>>(
        acc.data_ptr<int32_t>(), row_scale.data_ptr<float>(), weight_scales.data_ptr<float>(), x,
        input.stride(0), weight.data_ptr<int8_t>(), int32_or_null(num_outliers),
        int32_or_null(columns), b.defined() ? static_cast<const T*>(b.data_ptr()) : nullptr,
        static_cast<T*>(out.data_ptr()), m, n, k);
    KVSERVE_CUDA_CHECK_LAUNCH();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("llm_int8_linear", &llm_int8_linear_cuda); }

}  // namespace kvserve::ops
