// CUDA launcher for lora_add: the shared checks (the slots' values stay on the device), then one
// block per token.
#include <torch/library.h>

#include "kernels/cuda_launch.h"
#include "kernels/linear/lora_add.h"
#include "kernels/linear/lora_add_checks.h"
#include "kernels/linear/lora_add_kernel.cuh"

namespace kvserve::ops {
namespace {

// Shrunk vectors up to this rank fit the default 48 KiB of shared memory with room to spare.
constexpr int64_t kMaxRank = 4096;

void lora_add_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
                   const at::Tensor& lora_b, const at::Tensor& slots, const at::Tensor& scales) {
  check_lora_add(out, x, lora_a, lora_b, slots, scales);
  const int64_t rank = lora_a.size(1);
  TORCH_CHECK(rank <= kMaxRank, "lora_add: ranks up to ", kMaxRank, " on CUDA, got ", rank);
  if (x.size(0) == 0 || rank == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::dispatch_float(x.scalar_type(), "lora_add", [&](auto type) {
    using T = typename decltype(type)::type;
    cuda::lora_add_kernel<T><<<x.size(0), 256, rank * sizeof(float), cuda::current_stream()>>>(
        static_cast<T*>(out.data_ptr()), out.stride(0), static_cast<const T*>(x.data_ptr()),
        x.stride(0), static_cast<const T*>(lora_a.data_ptr()),
        static_cast<const T*>(lora_b.data_ptr()), slots.data_ptr<int32_t>(),
        scales.data_ptr<float>(), static_cast<int>(lora_a.size(0)), x.size(1), out.size(1),
        static_cast<int>(rank));
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("lora_add", &lora_add_cuda); }

}  // namespace kvserve::ops
