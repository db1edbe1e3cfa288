#pragma once
// ssm_scan's operands as the CPU and CUDA bodies take them, from the checked tensors.

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/cpu_kernels.h"

namespace kvserve::ops {

/// The operands of ssm_scan, after check_ssm_scan; A, D and dt_bias as fp32 copies kept alive
/// by the caller (`params` holds them).
inline cpu::SsmScanArgs ssm_scan_args(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt,
                                      const at::Tensor& B, const at::Tensor& C,
                                      at::Tensor& state, const at::Tensor& cu_seqlens,
                                      const at::Tensor& slots, const at::Tensor& has_initial_state,
                                      int64_t num_seqs, const float* A, bool A_per_state,
                                      const float* D,
                                      const float* dt_bias, bool dt_softplus, double dt_min,
                                      double dt_max) {
  cpu::SsmScanArgs a{};
  a.out = out.data_ptr();
  a.out_stride = out.stride(0);
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.dt = dt.data_ptr();
  a.dt_stride = dt.stride(0);
  a.B = B.data_ptr();
  a.B_stride = B.stride(0);
  a.C = C.data_ptr();
  a.C_stride = C.stride(0);
  a.A = A;
  a.A_per_state = A_per_state;
  a.D = D;
  a.dt_bias = dt_bias;
  a.state = state.data_ptr();
  a.fp32_state = state.scalar_type() == at::kFloat;
  a.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  a.slots = slots.data_ptr<int32_t>();
  a.has_initial_state = has_initial_state.data_ptr<bool>();
  a.num_seqs = num_seqs;
  a.heads = x.size(1);
  a.head_dim = x.size(2);
  a.groups = B.size(1);
  a.state_size = B.size(2);
  a.dt_softplus = dt_softplus;
  a.dt_min = static_cast<float>(dt_min);
  a.dt_max = static_cast<float>(dt_max);
  return a;
}

}  // namespace kvserve::ops
