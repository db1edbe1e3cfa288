// CPU launcher for rotary_embedding.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"
#include "kernels/rotary/rotary_embedding.h"
#include "kernels/rotary/rotary_embedding_checks.h"

namespace kvserve::ops {
namespace {

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                          int64_t head_dim, const at::Tensor& cos_sin_cache, bool is_neox,
                          const std::optional<at::Tensor>& query_norm,
                          const std::optional<at::Tensor>& key_norm, double norm_epsilon) {
  constexpr const char* op = "rotary_embedding";
  check_rotary_embedding(positions, query, key, head_dim, cos_sin_cache);
  const at::ScalarType norm_type =
      check_head_norms(query, head_dim, query_norm, key_norm, norm_epsilon);
  const int64_t num_tokens = positions.numel();
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, op, ": position ", pos[t],
                " is outside the rotary cache [0, ", max_position, ")");
  }
  cpu::rotary_embedding_stub.get()(query.scalar_type(), pos, query.data_ptr(), query.stride(0),
                                   query.size(1) / head_dim, key.data_ptr(), key.stride(0),
                                   key.size(1) / head_dim, head_dim,
                                   cos_sin_cache.data_ptr<float>(), cos_sin_cache.size(1),
                                   num_tokens, is_neox,
                                   query_norm ? query_norm->data_ptr() : nullptr,
                                   key_norm ? key_norm->data_ptr() : nullptr,
                                   norm_type == at::kFloat, static_cast<float>(norm_epsilon));
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("rotary_embedding", &rotary_embedding_cpu); }

}  // namespace kvserve::ops
