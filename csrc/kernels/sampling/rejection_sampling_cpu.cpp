// CPU launcher of rejection_sample: checks shapes, dtypes and the draft layout, then runs the body.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/sampling/rejection_sampling.h"
#include "kernels/sampling/rejection_sampling_checks.h"

namespace kvserve::ops {
namespace {

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& target_probs,
                                                        const at::Tensor& draft_probs,
                                                        const at::Tensor& draft_token_ids,
                                                        const at::Tensor& cu_num_drafts,
                                                        const at::Tensor& uniform) {
  check_rejection_sample(target_probs, draft_probs, draft_token_ids, cu_num_drafts, uniform);
  const int64_t batch = cu_num_drafts.numel() - 1;
  const int64_t vocab = target_probs.size(1);
  const int64_t* cu = cu_num_drafts.data_ptr<int64_t>();
  const int64_t max_k = check_cu_num_drafts(cu, batch, draft_token_ids.numel());
  const bool point_mass = draft_probs.numel() == 0;
  at::Tensor tokens = at::full({batch, max_k + 1}, -1, target_probs.options().dtype(at::kLong));
  at::Tensor accepted = at::empty({batch}, target_probs.options().dtype(at::kLong));
  cpu::rejection_sample_stub.get()(
      target_probs.data_ptr<float>(), target_probs.stride(0),
      point_mass ? nullptr : draft_probs.data_ptr<float>(),
      point_mass ? 0 : draft_probs.stride(0), vocab, draft_token_ids.data_ptr<int64_t>(), cu,
      batch, uniform.data_ptr<float>(), tokens.data_ptr<int64_t>(), max_k + 1,
      accepted.data_ptr<int64_t>());
  return {tokens, accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("rejection_sample", &rejection_sample_cpu); }

}  // namespace kvserve::ops
