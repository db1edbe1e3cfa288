// CUDA launcher for quantized_linear: the shared checks, then, by the number of tokens and the
// kernel choice (quantized_linear_kernel_choice.h): the quantized GEMV (each weight row read once
// for all of a few tokens; by 16-byte vectors where the data is aligned for them); tensor cores
// on the packed weight for bf16 / fp16 inputs, in blocks of 16 rows
// (quantized_linear_mma_kernel.cuh) or of 128-256 rows sharing the inputs staged in shared
// memory (quantized_linear_wide_kernel.cuh); or blocks of rows dequantized to the input dtype and
// multiplied by cuBLAS through at::linear.
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_launch.h"
#include "kernels/linear/quantized_linear.h"
#include "kernels/linear/quantized_linear_checks.h"
#include "kernels/linear/quantized_linear_kernel.cuh"
#include "kernels/linear/quantized_linear_kernel_choice.h"
#include "kernels/linear/quantized_linear_mma_kernel.cuh"
#include "kernels/linear/quantized_linear_wide_kernel.cuh"

namespace kvserve::ops {
namespace {

// Up to this many tokens the GEMV, bound by reading the packed weight once, beats dequantizing
// the weight (a write and a read of it in the input dtype) for a GEMM. Measured on an H100
// (bench_cuda_quant.py, Llama-3-8B shapes): at 8 tokens the vector GEMV takes 0.5-0.9x the
// time of the dequantizing path; at 16 (two launches) 1.0-1.3x, so 16 tokens dequantize.
constexpr int64_t kMaxGemvTokens = cuda::kQuantizedGemvTokens;
// auto: the GEMV for this many tokens, tensor cores from there up to kMaxMmaTokens, where the
// dequantizing GEMM takes over. Measured on an H200 (bench_cuda_quant.py --kernels mma gemv
// dequantize, Llama-3-8B shapes): the GEMV is 1.1-1.3x faster at one token, tensor cores
// 1.1-3.5x faster than the GEMV at 2-8 tokens and than dequantizing at 16-32, even at 64, and
// slower from 128.
constexpr int64_t kMaxAutoGemvTokens = 1;
constexpr int64_t kMaxMmaTokens = 64;
// Rows dequantized per GEMM: large enough for cuBLAS to fill the GPU, small next to the weights.
constexpr int64_t kDequantBlockBytes = 32 << 20;
constexpr int kDequantThreads = 128;

template <typename P>  // the scales' and zeros' dtype: float or __half
struct Weight {
  const uint8_t* q;
  const P* scales;
  const P* zeros;  // null: none
  int64_t n, k, group_size;
  bool aligned;  // 4-byte loads: q at a multiple of 4 and whole words per row
};

template <cuda::QuantFormat F>
bool rows_are_words(const at::Tensor& qweight, int64_t k) {
  return reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 4 == 0 &&
         cuda::quantized_row_bytes<F>(k) % 4 == 0;
}

// Calls f(integral_constant<int, P>{}) for the fewest tokens P (1, 2, 4 or 8) a GEMV launch
// for m tokens can be compiled for.
template <typename F>
void dispatch_tokens(int64_t m, F&& f) {
  if (m == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (m == 2) {
    f(std::integral_constant<int, 2>{});
  } else if (m <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, cuda::kQuantizedGemvTokens>{});
  }
}

template <typename T, cuda::QuantFormat F, typename P>
at::Tensor gemv(const at::Tensor& input, const Weight<P>& w,
                const std::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({input.size(0), w.n}, input.options());
  const unsigned int blocks = cuda::blocks_for_rows(w.n);
  const T* bias_data = bias ? static_cast<const T*>(bias->data_ptr()) : nullptr;
  const bool vector = cuda::vector_gemv_applies<F>(
      w.q, input.data_ptr(), input.stride(0) * input.element_size(), w.k, w.group_size);
  // m <= kQuantizedGemvTokens (run() sends more to the GEMM).
  const int m = static_cast<int>(input.size(0));
  const T* x = static_cast<const T*>(input.data_ptr());
  T* y = static_cast<T*>(out.data_ptr());
  if (!vector) {
    cuda::quantized_gemv_kernel<T, F, P>
        <<<blocks, cuda::kQuantizedGemvThreads, 0, cuda::current_stream()>>>(
            x, input.stride(0), m, w.q, w.scales, w.zeros, bias_data, y, w.n, w.k, w.group_size,
            w.aligned);
  } else {
    dispatch_tokens(m, [&](auto tokens) {
      constexpr int kTokens = decltype(tokens)::value;
      auto* kernel = w.zeros != nullptr
                         ? cuda::quantized_gemv_vector_kernel<T, F, kTokens, true, P>
                         : cuda::quantized_gemv_vector_kernel<T, F, kTokens, false, P>;
      kernel<<<blocks, cuda::kQuantizedGemvThreads, 0, cuda::current_stream()>>>(
          x, input.stride(0), m, w.q, w.scales, w.zeros, bias_data, y, w.n, w.k, w.group_size);
    });
  }
  KVSERVE_CUDA_CHECK_LAUNCH();
  return out;
}

// Rows [r, r + block.size(0)) of the weight dequantized into block [rows, k] (the input dtype).
template <typename T, cuda::QuantFormat F, typename P>
void dequantize(const Weight<P>& w, int64_t r, at::Tensor& block) {
  if (cuda::vector_rows_apply<F>(w.q, w.k, w.group_size)) {
    const dim3 grid(block.size(0), cuda::blocks_for(w.k / cuda::kVectorInputs<F>,
                                                    kDequantThreads));
    cuda::quantized_dequantize_vector_kernel<T, F, P>
        <<<grid, kDequantThreads, 0, cuda::current_stream()>>>(
            w.q, w.scales, w.zeros, static_cast<T*>(block.data_ptr()), r, w.k, w.group_size);
  } else {
    const dim3 grid(block.size(0), cuda::blocks_for(cuda::quantized_row_bytes<F>(w.k),
                                                    4 * kDequantThreads));
    cuda::quantized_dequantize_kernel<T, F, P><<<grid, kDequantThreads, 0, cuda::current_stream()>>>(
        w.q, w.scales, w.zeros, static_cast<T*>(block.data_ptr()), r, w.k, w.group_size,
        w.aligned);
  }
  KVSERVE_CUDA_CHECK_LAUNCH();
}

template <typename T, cuda::QuantFormat F, typename P>
at::Tensor dequantize_and_gemm(const at::Tensor& input, const Weight<P>& w,
                               const std::optional<at::Tensor>& bias) {
  const int64_t rows = std::max<int64_t>(
      64, kDequantBlockBytes / (w.k * static_cast<int64_t>(input.element_size())));
  at::Tensor block = at::empty({std::min(rows, w.n), w.k}, input.options());
  if (rows >= w.n) {  // one block: cuBLAS writes the output directly
    dequantize<T, F>(w, 0, block);
    return at::linear(input, block, bias);
  }
  at::Tensor out = at::empty({input.size(0), w.n}, input.options());
  for (int64_t r = 0; r < w.n; r += rows) {
    at::Tensor part = block.narrow(0, 0, std::min(rows, w.n - r));
    dequantize<T, F>(w, r, part);
    const std::optional<at::Tensor> part_bias =
        bias ? std::optional<at::Tensor>(bias->narrow(0, r, part.size(0))) : std::nullopt;
    out.narrow(1, r, part.size(0)).copy_(at::linear(input, part, part_bias));
  }
  return out;
}

// Calls f(integral_constant<int, tiles>{}) for tiles = 1, 2, 4 or 8 token tiles of the mma GEMM.
template <typename F>
void dispatch_tiles(int tiles, F&& f) {
  switch (tiles) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      f(std::integral_constant<int, cuda::kMmaGemmMaxTiles>{});
      break;
  }
}

// Whether the tensor-core GEMM applies: 16-bit inputs, aligned vectors of weight and input, a
// GPU with mma.sync (sm_80 or later), and a grid that fits.
template <typename T, cuda::QuantFormat F, typename P>
bool mma_applies(const at::Tensor& input, const Weight<P>& w) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    const int64_t m = input.size(0);
    return w.k > 0 &&
           cuda::vector_gemv_applies<F>(
               w.q, input.data_ptr(), input.stride(0) * input.element_size(), w.k, w.group_size) &&
           cuda::mma_gemm_blocks(m, w.n, cuda::mma_gemm_tiles(m)) <= INT32_MAX &&
           cuda::tensor_cores(input.device().index());
  }
}

template <typename T, cuda::QuantFormat F, typename P>
at::Tensor mma_gemm(const at::Tensor& input, const Weight<P>& w,
                    const std::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({input.size(0), w.n}, input.options());
  if constexpr (!std::is_same_v<T, float>) {
    const int64_t m = input.size(0);
    dispatch_tiles(cuda::mma_gemm_tiles(m), [&](auto tiles) {
      constexpr int kTiles = decltype(tiles)::value;
      auto* kernel = w.zeros != nullptr
                         ? cuda::quantized_gemm_mma_kernel<T, F, kTiles, true, P>
                         : cuda::quantized_gemm_mma_kernel<T, F, kTiles, false, P>;
      kernel<<<static_cast<unsigned int>(cuda::mma_gemm_blocks(m, w.n, kTiles)),
               cuda::kMmaGemmThreads, cuda::mma_gemm_shared_bytes(kTiles),
               cuda::current_stream()>>>(static_cast<const T*>(input.data_ptr()), input.stride(0),
                                         m, w.q, w.scales, w.zeros,
                                         bias ? static_cast<const T*>(bias->data_ptr()) : nullptr,
                                         static_cast<T*>(out.data_ptr()), w.n, w.k, w.group_size);
    });
    KVSERVE_CUDA_CHECK_LAUNCH();
  }
  return out;
}

// Whether the wide tensor-core GEMM applies: where the narrow one does, with its shared memory
// (up to 139 KiB for int4 at 64 tokens a block) within what the device lets a block opt into.
template <typename T, cuda::QuantFormat F, typename P>
bool wide_applies(const at::Tensor& input, const Weight<P>& w) {
  const int64_t m = input.size(0);
  const int tiles = cuda::mma_gemm_tiles(m);
  return mma_applies<T, F, P>(input, w) &&
         cuda::wide_gemm_shared_bytes<F>(tiles) <=
             static_cast<size_t>(cuda::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(
                 input.device().index())) &&
         cuda::wide_gemm_tiles(m, w.n, tiles) * cuda::wide_gemm_k_blocks<F>(w.k) <= INT32_MAX;
}

template <typename T, cuda::QuantFormat F, typename P>
at::Tensor wide_gemm(const at::Tensor& input, const Weight<P>& w,
                     const std::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({input.size(0), w.n}, input.options());
  if constexpr (!std::is_same_v<T, float>) {
    const int64_t m = input.size(0);
    const int device = input.device().index();
    const cudaStream_t stream = cuda::current_stream();
    dispatch_tiles(cuda::mma_gemm_tiles(m), [&](auto tiles) {
      constexpr int kTiles = decltype(tiles)::value;
      auto* kernel = w.zeros != nullptr
                         ? cuda::quantized_gemm_wide_kernel<T, F, kTiles, true, P>
                         : cuda::quantized_gemm_wide_kernel<T, F, kTiles, false, P>;
      constexpr size_t kShared = cuda::wide_gemm_shared_bytes<F>(kTiles);
      const void* address = reinterpret_cast<const void*>(kernel);
      const int64_t tile_count = cuda::wide_gemm_tiles(m, w.n, kTiles);
      const int64_t resident = static_cast<int64_t>(cuda::multiprocessors(device)) *
                               cuda::resident_blocks(address, device, stream,
                                                     cuda::kWideGemmThreads, kShared);
      const int splits =
          cuda::wide_gemm_splits(tile_count, cuda::wide_gemm_k_blocks<F>(w.k), resident);
      at::Tensor partials, counters;
      if (splits > 1) {
        partials = at::empty({splits, m, w.n}, input.options().dtype(at::kFloat));
        counters = at::empty({tile_count}, input.options().dtype(at::kInt));
        // A memset node, not a fill kernel: less of the host's time per call.
        C10_CUDA_CHECK(cudaMemsetAsync(counters.data_ptr(), 0, tile_count * sizeof(int), stream));
      }
      cuda::allow_shared_bytes(address, kShared);
      kernel<<<static_cast<unsigned int>(tile_count * splits), cuda::kWideGemmThreads, kShared,
               stream>>>(static_cast<const T*>(input.data_ptr()), input.stride(0), m, w.q,
                         w.scales, w.zeros,
                         bias ? static_cast<const T*>(bias->data_ptr()) : nullptr,
                         static_cast<T*>(out.data_ptr()), w.n, w.k, w.group_size, splits,
                         splits > 1 ? partials.data_ptr<float>() : nullptr,
                         splits > 1 ? counters.data_ptr<int>() : nullptr);
      KVSERVE_CUDA_CHECK_LAUNCH();
    });
  }
  return out;
}

template <typename T, cuda::QuantFormat F, typename P>
at::Tensor run(const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& scales,
               const std::optional<at::Tensor>& zeros, int64_t group_size,
               const std::optional<at::Tensor>& bias) {
  const int64_t k = input.size(1), m = input.size(0);
  const Weight<P> w{static_cast<const uint8_t*>(qweight.data_ptr()),
                    static_cast<const P*>(scales.data_ptr()),
                    zeros ? static_cast<const P*>(zeros->data_ptr()) : nullptr,
                    qweight.size(0),
                    k,
                    group_size,
                    rows_are_words<F>(qweight, k)};
  using Kernel = QuantizedLinearKernel;
  const Kernel choice = quantized_linear_kernel();
  if (choice == Kernel::kWide && wide_applies<T, F, P>(input, w)) {
    return wide_gemm<T, F>(input, w, bias);
  }
  // Where wide does not apply (fp32 inputs, a device with less shared memory) it runs as auto.
  const bool as_auto = choice == Kernel::kAuto || choice == Kernel::kWide;
  const bool mma = (choice == Kernel::kMma ||
                    (as_auto && m > kMaxAutoGemvTokens && m <= kMaxMmaTokens)) &&
                   mma_applies<T, F, P>(input, w);
  if (mma) return mma_gemm<T, F>(input, w, bias);
  // k == 0 takes the GEMV: it writes the bias (or 0) where a 0-wide grid could not launch.
  const bool dequantize = k > 0 && (m > kMaxGemvTokens || choice == Kernel::kDequantize);
  if (dequantize) return dequantize_and_gemm<T, F>(input, w, bias);
  return gemv<T, F>(input, w, bias);
}

at::Tensor quantized_linear_cuda(const at::Tensor& input, const at::Tensor& qweight,
                                 const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                 int64_t group_size, const std::optional<at::Tensor>& bias,
                                 bool quantize_input,
                                 const std::optional<at::Tensor>& super_scales,
                                 const std::optional<at::Tensor>& super_mins) {
  const cpu::QuantFormat format = check_quantized_linear(
      input, qweight, scales, zeros, group_size, bias, quantize_input, super_scales, super_mins);
  TORCH_CHECK(!super_scales, "quantized_linear: two-level scales (K-quants) run on the CPU; on "
                             "CUDA give the one-level form (QuantizedWeight.one_level())");
  if (input.size(0) == 0 || qweight.size(0) == 0) {
    return at::empty({input.size(0), qweight.size(0)}, input.options());
  }
  const c10::cuda::CUDAGuard guard(input.device());
  // A shared zero ([1]) as the kernels index zeros: [n, groups].
  const std::optional<at::Tensor> row_zeros =
      is_shared_zero(zeros)
          ? std::optional<at::Tensor>(zeros->view({1, 1})
                                          .expand({qweight.size(0), input.size(1) / group_size})
                                          .contiguous())
          : zeros;
  // quantize_input: no integer kernel here yet; the rounded input takes the exact paths.
  const at::Tensor source =
      quantize_input ? round_input_to_int8_blocks(input, group_size).to(input.scalar_type())
                     : input;
  at::Tensor out;
  const auto by_format = [&]<typename T, typename P>() {
    switch (format) {
      case cpu::QuantFormat::kInt8:
        out = run<T, cuda::QuantFormat::kInt8, P>(source, qweight, scales, row_zeros, group_size,
                                                  bias);
        break;
      case cpu::QuantFormat::kInt4:
        out = run<T, cuda::QuantFormat::kInt4, P>(source, qweight, scales, row_zeros, group_size,
                                                  bias);
        break;
      case cpu::QuantFormat::kFp8E4M3:
        out = run<T, cuda::QuantFormat::kFp8E4M3, P>(input, qweight, scales, row_zeros, group_size,
                                                     bias);
        break;
    }
  };
  cuda::dispatch_float(input.scalar_type(), "quantized_linear", [&](auto type) {
    using T = typename decltype(type)::type;
    if (scales.scalar_type() == at::kHalf) {
      by_format.template operator()<T, __half>();
    } else {
      by_format.template operator()<T, float>();
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("quantized_linear", &quantized_linear_cuda); }

}  // namespace kvserve::ops
