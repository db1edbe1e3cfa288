// CUDA launcher of rejection_sample: the shared checks, then one block per sequence.
// cu_num_drafts sets the width of the tokens returned (the most drafts of a sequence, + 1):
//  - on the host (the engine knows its drafts there), it is checked like the CPU launcher's and
//    copied to the device, and the width is exact;
//  - on the device, reading it would synchronise: it is used unchecked (the body clamps each
//    sequence's draft range into bounds), and the width is the most it can be, num_drafts + 1,
//    the columns past a sequence's tokens holding -1 as the contract's do.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <tuple>

#include "kernels/cuda_launch.h"
#include "kernels/sampling/rejection_sampling.h"
#include "kernels/sampling/rejection_sampling_checks.h"
#include "kernels/sampling/rejection_sampling_kernel.cuh"

namespace kvserve::ops {
namespace {

constexpr int kThreads = 256;

std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(const at::Tensor& target_probs,
                                                         const at::Tensor& draft_probs,
                                                         const at::Tensor& draft_token_ids,
                                                         const at::Tensor& cu_num_drafts,
                                                         const at::Tensor& uniform) {
  check_rejection_sample(target_probs, draft_probs, draft_token_ids, cu_num_drafts, uniform);
  const int64_t batch = cu_num_drafts.numel() - 1, num_drafts = draft_token_ids.numel();
  const at::Device device = target_probs.device();
  at::Tensor cu = cu_num_drafts;
  int64_t width = num_drafts + 1;
  if (cu.is_cpu()) {
    width = check_cu_num_drafts(cu.data_ptr<int64_t>(), batch, num_drafts) + 1;
  } else {
    TORCH_CHECK(cu.device() == device, "rejection_sample: cu_num_drafts is on ", cu.device(),
                ", target_probs on ", device);
  }
  const auto options = target_probs.options().dtype(at::kLong);
  at::Tensor tokens = at::full({batch, width}, -1, options);
  at::Tensor accepted = at::empty({batch}, options);
  if (batch == 0) return {tokens, accepted};
  const c10::cuda::CUDAGuard guard(device);
  // Through pinned memory, so that the copy does not wait for the host.
  if (cu.is_cpu()) cu = cu.pin_memory().to(device, /*non_blocking=*/true);
  const bool point_mass = draft_probs.numel() == 0;
  cuda::rejection_sample_kernel<kThreads><<<batch, kThreads, 0, cuda::current_stream()>>>(
      target_probs.data_ptr<float>(), target_probs.stride(0),
      point_mass ? nullptr : draft_probs.data_ptr<float>(), point_mass ? 0 : draft_probs.stride(0),
      target_probs.size(1), draft_token_ids.data_ptr<int64_t>(), cu.data_ptr<int64_t>(),
      num_drafts, uniform.data_ptr<float>(), tokens.data_ptr<int64_t>(), width,
      accepted.data_ptr<int64_t>());
  KVSERVE_CUDA_CHECK_LAUNCH();
  return {tokens, accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("rejection_sample", &rejection_sample_cuda); }

}  // namespace kvserve::ops
