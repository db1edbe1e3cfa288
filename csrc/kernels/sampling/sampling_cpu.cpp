// CPU launchers for the sampling ops.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/sampling/sampling.h"
#include "kernels/sampling/sampling_checks.h"

namespace kvserve::ops {
namespace {

void sampling_filter_logits_cpu(at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& top_k, const at::Tensor& top_p,
                                const at::Tensor& min_p) {
  check_sampling_filter_logits(logits, temperature, top_k, top_p, min_p);
  cpu::sampling_filter_stub.get()(logits.data_ptr<float>(), logits.stride(0), logits.size(0),
                                  logits.size(1), temperature.data_ptr<float>(),
                                  top_k.data_ptr<int64_t>(), top_p.data_ptr<float>(),
                                  min_p.data_ptr<float>());
}

at::Tensor sampling_from_logits_cpu(const at::Tensor& logits, const at::Tensor& temperature,
                                    const at::Tensor& uniform) {
  check_sampling_from_logits(logits, temperature, uniform);
  const int64_t rows = logits.size(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  cpu::sampling_sample_stub.get()(logits.data_ptr<float>(), logits.stride(0), rows, logits.size(1),
                                  temperature.data_ptr<float>(), uniform.data_ptr<float>(),
                                  out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("sampling_filter_logits", &sampling_filter_logits_cpu);
  m.impl("sampling_from_logits", &sampling_from_logits_cpu);
}

}  // namespace kvserve::ops
