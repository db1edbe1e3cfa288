// CUDA launcher for paged_attention: the shared checks, then the kernel that paged_attention's
// host plan picks (paged_attention_cuda_launch.h), started on torch's current stream.
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include "kernels/attention/paged_attention.h"
#include "kernels/attention/paged_attention_checks.h"
#include "kernels/attention/paged_attention_cuda_launch.h"
#include "kernels/cuda_launch.h"

namespace kvserve::ops {
namespace {

// Starts a kernel on the current stream, with the shared memory it asks for.
struct StreamLaunch {
  cudaStream_t stream;
  int device;
  using Kernel = void (*)(cuda::PagedAttentionParams);

  bool tensor_cores() const { return cuda::tensor_cores(device); }

  void operator()(Kernel kernel, dim3 grid, int threads, size_t shared_bytes,
                  const cuda::PagedAttentionParams& p) const {
    cuda::allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes);
    kernel<<<grid, threads, shared_bytes, stream>>>(p);
    KVSERVE_CUDA_CHECK_LAUNCH();
  }

  int resident_blocks(Kernel kernel, int threads, size_t shared_bytes) const {
    return cuda::resident_blocks(reinterpret_cast<const void*>(kernel), device, stream, threads,
                                 shared_bytes);
  }
};

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, const at::Tensor& block_tables,
                          double scale, int64_t sliding_window, double logit_softcap,
                          const std::optional<at::Tensor>& key_scale,
                          const std::optional<at::Tensor>& value_scale,
                          const std::optional<at::Tensor>& sinks) {
  const cpu::KVCacheFormat format =
      check_paged_attention(out, query, key_cache, value_cache, query_start_loc, seq_lens,
                            block_tables, key_scale, value_scale, sinks);
  const int64_t num_tokens = query.size(0);
  if (num_tokens == 0 || seq_lens.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  cuda::PagedAttentionParams p = paged_attention_launch::make_params(
      out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
      sliding_window, logit_softcap, key_scale, value_scale, sinks);
  if (p.max_blocks_per_seq == 0) {
    out.zero_();
    return;
  }
  const int sms = cuda::multiprocessors(query.device().index());
  const AttentionKernel kernel = attention_kernel();
  StreamLaunch launch{cuda::current_stream(), query.device().index()};
  cuda::dispatch_float(query.scalar_type(), paged_attention_checks::kOp, [&](auto type) {
    using T = typename decltype(type)::type;
    switch (format) {
      case cpu::KVCacheFormat::kPlain:
        paged_attention_launch::launch_kernel<T, cuda::KVFormat::kPlain>(p, num_tokens, sms, query,
                                                                       kernel, launch);
        break;
      case cpu::KVCacheFormat::kInt8:
        paged_attention_launch::launch_kernel<T, cuda::KVFormat::kInt8>(p, num_tokens, sms, query,
                                                                      kernel, launch);
        break;
      case cpu::KVCacheFormat::kFp8E4M3:
        paged_attention_launch::launch_kernel<T, cuda::KVFormat::kFp8E4M3>(p, num_tokens, sms,
                                                                         query, kernel, launch);
        break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("paged_attention", &paged_attention_cuda); }

}  // namespace kvserve::ops
