// CUDA launchers for the sampling ops: the CPU launchers' checks (sampling_checks.h), then one
// thread block per row on the current stream. Nothing is read back to the host.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>

#include "kernels/cuda_launch.h"
#include "kernels/sampling/sampling.h"
#include "kernels/sampling/sampling_checks.h"
#include "kernels/sampling/sampling_kernel.cuh"

namespace kvserve::ops {
namespace {

// Small vocabularies leave most of a large block idle; large ones want many loads in flight. 512
// (not 1024) threads leave the filter's 16 fp64 histogram buckets in registers without spilling.
constexpr int kSmallBlock = 128, kLargeBlock = 512;
constexpr int64_t kLargeVocab = 4096;

void sampling_filter_logits_cuda(at::Tensor& logits, const at::Tensor& temperature,
                                 const at::Tensor& top_k, const at::Tensor& top_p,
                                 const at::Tensor& min_p) {
  check_sampling_filter_logits(logits, temperature, top_k, top_p, min_p);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0 || vocab == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  auto launch = [&](auto kernel, int threads) {
    kernel<<<rows, threads, 0, cuda::current_stream()>>>(
        logits.data_ptr<float>(), logits.stride(0), vocab, temperature.data_ptr<float>(),
        top_k.data_ptr<int64_t>(), top_p.data_ptr<float>(), min_p.data_ptr<float>());
  };
  if (vocab >= kLargeVocab) {
    launch(cuda::sampling_filter_kernel<kLargeBlock>, kLargeBlock);
  } else {
    launch(cuda::sampling_filter_kernel<kSmallBlock>, kSmallBlock);
  }
  KVSERVE_CUDA_CHECK_LAUNCH();
}

at::Tensor sampling_from_logits_cuda(const at::Tensor& logits, const at::Tensor& temperature,
                                     const at::Tensor& uniform) {
  check_sampling_from_logits(logits, temperature, uniform);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  // The kernel packs a token's index in 32 bits beside its value for the argmax.
  TORCH_CHECK(vocab <= std::numeric_limits<uint32_t>::max(),
              "sampling_from_logits: a vocabulary of ", vocab, " tokens is too large for CUDA");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows == 0) return out;
  const c10::cuda::CUDAGuard guard(logits.device());
  auto launch = [&](auto kernel, int threads) {
    kernel<<<rows, threads, 0, cuda::current_stream()>>>(
        logits.data_ptr<float>(), logits.stride(0), vocab, temperature.data_ptr<float>(),
        uniform.data_ptr<float>(), out.data_ptr<int64_t>());
  };
  if (vocab >= kLargeVocab) {
    launch(cuda::sampling_sample_kernel<kLargeBlock>, kLargeBlock);
  } else {
    launch(cuda::sampling_sample_kernel<kSmallBlock>, kSmallBlock);
  }
  KVSERVE_CUDA_CHECK_LAUNCH();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) {
  m.impl("sampling_filter_logits", &sampling_filter_logits_cuda);
  m.impl("sampling_from_logits", &sampling_from_logits_cuda);
}

}  // namespace kvserve::ops
