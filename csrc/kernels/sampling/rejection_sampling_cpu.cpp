// CPU launcher of rejection_sample: checks shapes, dtypes and the draft layout, then runs the body.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"
#include "kernels/sampling/rejection_sampling.h"

namespace kvserve::ops {
namespace {

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& target_probs,
                                                        const at::Tensor& draft_probs,
                                                        const at::Tensor& draft_token_ids,
                                                        const at::Tensor& cu_num_drafts,
                                                        const at::Tensor& uniform) {
  constexpr const char* op = "rejection_sample";
  check_rows(op, "target_probs", target_probs, 2);
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat, op, ": target_probs must be float32");
  check_contiguous(op, "draft_token_ids", draft_token_ids, at::kLong);
  check_contiguous(op, "cu_num_drafts", cu_num_drafts, at::kLong);
  check_contiguous(op, "uniform", uniform, at::kFloat);
  TORCH_CHECK(draft_token_ids.dim() == 1 && cu_num_drafts.dim() == 1 && uniform.dim() == 1, op,
              ": draft_token_ids, cu_num_drafts and uniform must be 1-d");
  const int64_t batch = cu_num_drafts.numel() - 1;
  TORCH_CHECK(batch >= 0, op, ": cu_num_drafts needs B + 1 entries");
  const int64_t num_drafts = draft_token_ids.numel();
  const int64_t vocab = target_probs.size(1);
  TORCH_CHECK(vocab > 0, op, ": empty vocabulary");
  const int64_t* cu = cu_num_drafts.data_ptr<int64_t>();
  int64_t max_k = 0;
  TORCH_CHECK(cu[0] == 0 && cu[batch] == num_drafts, op, ": cu_num_drafts must run from 0 to ",
              num_drafts, " (the number of draft tokens)");
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(cu[b + 1] >= cu[b], op, ": cu_num_drafts must be non-decreasing");
    max_k = std::max(max_k, cu[b + 1] - cu[b]);
  }
  TORCH_CHECK(target_probs.size(0) == num_drafts + batch, op, ": target_probs needs ",
              num_drafts + batch, " rows (one per draft and one bonus row per sequence), got ",
              target_probs.size(0));
  TORCH_CHECK(uniform.numel() == num_drafts + batch, op, ": uniform needs one entry per "
              "target row (", num_drafts + batch, ")");
  const bool point_mass = draft_probs.numel() == 0;
  if (!point_mass) {
    check_rows(op, "draft_probs", draft_probs, 2);
    TORCH_CHECK(draft_probs.scalar_type() == at::kFloat, op, ": draft_probs must be float32");
    TORCH_CHECK(draft_probs.size(0) == num_drafts && draft_probs.size(1) == vocab, op,
                ": draft_probs must be [", num_drafts, ", ", vocab, "], got ", draft_probs.sizes());
  }
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
