#pragma once
// What the CPU launchers of fused_moe and fused_moe_quantized share: tokens grouped by the
// experts their router chose, each active expert's MLP run on its tokens, and the weighted sum.

#include <ATen/core/Tensor.h>

#include <functional>

namespace kvserve::ops {

/// One expert's gated MLP on its tokens: (expert id, x [n, hidden_size]) -> [n, hidden_size],
/// contiguous, in x's dtype.
using ExpertMlp = std::function<at::Tensor(int64_t expert, const at::Tensor& x)>;

/// out[t] = sum_j topk_weights[t, j] * mlp(topk_ids[t, j], hidden[t]) for hidden [T, hidden_size]
/// (rows may be strided). Each active expert runs once on all of its tokens; experts run side by
/// side (one thread each) while none has more than a few tokens (decode, where each is a GEMV
/// bound by reading its weights), else one at a time with every thread. The sum is accumulated
/// in fp32 in slot order j. topk_weights: fp32 [T, k]; topk_ids: int64 [T, k], both contiguous,
/// as the caller checked them (check_moe_topk). Throws c10::Error, naming `op`, on an expert id
/// outside [0, num_experts), before any expert runs.
/// relu(up)^2 in place, in up's dtype (the reference's rounding): the activation of experts
/// without a gate (fused_moe's "relu2"). Returns up.
at::Tensor squared_relu_(at::Tensor up);

at::Tensor routed_experts_cpu(const char* op, const at::Tensor& hidden, int64_t num_experts,
                              const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                              const ExpertMlp& mlp);

}  // namespace kvserve::ops
