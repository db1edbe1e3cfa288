// CPU launcher for rotary_embedding.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"
#include "kernels/rotary/rotary_embedding.h"
#include "kernels/rotary/rotary_embedding_checks.h"

namespace kvserve::ops {
namespace {

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                          int64_t head_dim, const at::Tensor& cos_sin_cache, bool is_neox) {
  constexpr const char* op = "rotary_embedding";
  check_rotary_embedding(positions, query, key, head_dim, cos_sin_cache);
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
                                   num_tokens, is_neox);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("rotary_embedding", &rotary_embedding_cpu); }

}  // namespace kvserve::ops
