#include "kernels/moe/routed_experts_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/relu.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu_kernels.h"

namespace kvserve::ops {
namespace {

// Experts run side by side (each on one thread) while none has more tokens than this: their
// projections are then GEMVs bound by reading the expert's weights, and one thread per expert
// keeps every core streaming a different expert. Above it, one expert at a time uses all threads.
constexpr int64_t kMaxTokensPerParallelExpert = 8;

// The (token, slot) pairs of each expert, in token order.
struct Routing {
  std::vector<int64_t> offsets;  // [num_experts + 1] into pairs
  std::vector<int64_t> pairs;    // t * k + j
};

Routing group_by_expert(const char* op, const int64_t* ids, int64_t num_pairs,
                        int64_t num_experts) {
  Routing r;
  r.offsets.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, op, ": expert id ", ids[p],
                " is outside [0, ", num_experts, ")");
    ++r.offsets[ids[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) r.offsets[e + 1] += r.offsets[e];
  r.pairs.resize(num_pairs);
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) r.pairs[next[ids[p]]++] = p;
  return r;
}

}  // namespace

at::Tensor squared_relu_(at::Tensor up) {
  at::relu_(up);
  return up.mul_(up);
}

at::Tensor routed_experts_cpu(const char* op, const at::Tensor& hidden, int64_t num_experts,
                              const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                              const ExpertMlp& mlp) {
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t k = topk_ids.size(1);
  at::Tensor out = at::empty({num_tokens, hidden_size}, hidden.options());
  if (num_tokens == 0) return out;

  const Routing routing = group_by_expert(op, topk_ids.data_ptr<int64_t>(), num_tokens * k,
                                          num_experts);
  const auto count = [&](int64_t e) { return routing.offsets[e + 1] - routing.offsets[e]; };
  std::vector<int64_t> active;  // experts with tokens, most tokens first
  int64_t most = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count(e) > 0) active.push_back(e);
    most = std::max(most, count(e));
  }
  std::stable_sort(active.begin(), active.end(),
                   [&](int64_t a, int64_t b) { return count(a) > count(b); });

  // Each (token, slot) pair's expert output: [T * k, hidden_size], rows in pair order.
  at::Tensor pair_out = at::empty({num_tokens * k, hidden_size}, hidden.options());
  const int64_t row_bytes = hidden_size * static_cast<int64_t>(hidden.element_size());
  auto run_expert = [&](int64_t e) {
    const int64_t begin = routing.offsets[e], n = count(e);
    std::vector<int64_t> tokens(n);
    for (int64_t i = 0; i < n; ++i) tokens[i] = routing.pairs[begin + i] / k;
    const at::Tensor x = n == num_tokens && k == 1
                             ? hidden
                             : hidden.index_select(0, at::from_blob(tokens.data(), {n}, at::kLong));
    const at::Tensor y = mlp(e, x);  // [n, hidden_size], contiguous
    const auto* src = static_cast<const char*>(y.data_ptr());
    auto* dst = static_cast<char*>(pair_out.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(dst + routing.pairs[begin + i] * row_bytes, src + i * row_bytes, row_bytes);
    }
  };
  if (most <= kMaxTokensPerParallelExpert && active.size() > 1) {
    at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) run_expert(active[i]);
    });
  } else {
    for (int64_t e : active) run_expert(e);
  }
  cpu::moe_combine_stub.get()(hidden.scalar_type(), pair_out.data_ptr(),
                              topk_weights.data_ptr<float>(), out.data_ptr(), num_tokens, k,
                              hidden_size);
  return out;
}

}  // namespace kvserve::ops
