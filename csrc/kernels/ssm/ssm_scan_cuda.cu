// CUDA launcher for ssm_scan: the CPU launcher's checks (but for the values of cu_seqlens and
// slots, which the kernel bounds), then a block per (sequence, head) on the current stream with
// the head's state in shared memory: in the recurrent form when every sequence has one token
// (decode), else in the chunked form (ssm_chunk_scan_kernel.cuh) when its chunk fits in shared
// memory and A has a rate a head (Mamba2; Mamba's per-state A runs the recurrent form). Which one
// runs is decided from the shapes alone (no copy of cu_seqlens to the host).
#include <torch/library.h>

#include <type_traits>

#include "kernels/cuda_launch.h"
#include "kernels/ssm/ssm_checks.h"
#include "kernels/ssm/ssm_scan.h"
#include "kernels/ssm/ssm_chunk_scan_kernel.cuh"
#include "kernels/ssm/ssm_scan_kernel.cuh"

namespace kvserve::ops {
namespace {

void ssm_scan_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                   const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
                   const std::optional<at::Tensor>& dt_bias, at::Tensor& state,
                   const at::Tensor& cu_seqlens, const at::Tensor& slots,
                   const at::Tensor& has_initial_state, bool dt_softplus, double dt_min,
                   double dt_max) {
  const int64_t num_seqs = check_ssm_scan(out, x, dt, A, B, C, D, dt_bias, state, cu_seqlens,
                                          slots, has_initial_state);
  check_dt_limits(dt_min, dt_max);
  if (num_seqs == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const std::optional<at::Tensor> d =
      D ? std::optional<at::Tensor>(D->to(at::kFloat).contiguous()) : std::nullopt;
  const std::optional<at::Tensor> bias =
      dt_bias ? std::optional<at::Tensor>(dt_bias->to(at::kFloat).contiguous()) : std::nullopt;
  const int64_t recurrent_shared = x.size(2) * B.size(2) * static_cast<int64_t>(sizeof(float));
  const int64_t chunked_shared = cuda::ssm_chunk_scan_shared_floats(x.size(2), B.size(2)) *
                                 static_cast<int64_t>(sizeof(float));
  const int max_shared = cuda::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(
      x.device().index());
  TORCH_CHECK(recurrent_shared <= max_shared, "ssm_scan: a head's state of ", x.size(2), " x ",
              B.size(2), " floats exceeds the ", max_shared,
              " bytes of shared memory a block may have");
  const bool chunked = x.size(0) > num_seqs && chunked_shared <= max_shared && A.dim() == 1;
  const int64_t shared = chunked ? chunked_shared : recurrent_shared;
  const dim3 grid(static_cast<unsigned>(x.size(1)), static_cast<unsigned>(num_seqs));
  const int threads = chunked ? 256 : cuda::ssm_scan_threads(x.size(2));
  cuda::dispatch_float(x.scalar_type(), "ssm_scan", [&](auto type) {
    using T = typename decltype(type)::type;
    const auto launch = [&](auto* pool) {
      using S = std::remove_pointer_t<decltype(pool)>;
      cuda::SsmScanParams<T, S> p{};
      p.out = static_cast<T*>(out.data_ptr());
      p.out_stride = out.stride(0);
      p.x = static_cast<const T*>(x.data_ptr());
      p.x_stride = x.stride(0);
      p.dt = static_cast<const T*>(dt.data_ptr());
      p.dt_stride = dt.stride(0);
      p.B = static_cast<const T*>(B.data_ptr());
      p.B_stride = B.stride(0);
      p.C = static_cast<const T*>(C.data_ptr());
      p.C_stride = C.stride(0);
      p.A = A.data_ptr<float>();
      p.A_per_state = A.dim() == 2;
      p.D = d ? d->data_ptr<float>() : nullptr;
      p.dt_bias = bias ? bias->data_ptr<float>() : nullptr;
      p.state = pool;
      p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
      p.slots = slots.data_ptr<int32_t>();
      p.has_initial_state = has_initial_state.data_ptr<bool>();
      p.num_tokens = x.size(0);
      p.num_slots = state.size(0);
      p.heads = x.size(1);
      p.head_dim = x.size(2);
      p.groups = B.size(1);
      p.state_size = B.size(2);
      p.dt_softplus = dt_softplus;
      p.dt_min = static_cast<float>(dt_min);
      p.dt_max = static_cast<float>(dt_max);
      const auto kernel =
          chunked ? cuda::ssm_chunk_scan_kernel<T, S> : cuda::ssm_scan_kernel<T, S>;
      if (shared > 48 * 1024) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(shared)));
      }
      kernel<<<grid, threads, shared, cuda::current_stream()>>>(p);
    };
    if (state.scalar_type() == at::kFloat) {
      launch(static_cast<float*>(state.data_ptr()));
    } else {
      launch(static_cast<T*>(state.data_ptr()));
    }
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("ssm_scan", &ssm_scan_cuda); }

}  // namespace kvserve::ops
