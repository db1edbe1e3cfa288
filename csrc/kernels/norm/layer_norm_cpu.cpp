// CPU launcher for layer_norm: the weight and bias as fp32 (a no-op for the model's, which are
// kept in fp32), then the body of the CPU's capability.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/norm/layer_norm.h"
#include "kernels/norm/layer_norm_checks.h"

namespace kvserve::ops {
namespace {

void layer_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, double epsilon) {
  check_layer_norm(out, input, weight, bias);
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  cpu::layer_norm_stub.get()(input.scalar_type(), out.data_ptr(), out.stride(0),
                             input.data_ptr(), input.stride(0), w.data_ptr<float>(),
                             b.defined() ? b.data_ptr<float>() : nullptr, input.size(0),
                             input.size(1), static_cast<float>(epsilon));
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("layer_norm", &layer_norm_cpu); }

}  // namespace kvserve::ops
