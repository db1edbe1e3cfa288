#pragma once
// Argument checks that the state-space ops' CPU and CUDA launchers share.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Checks cu_seqlens int32 [num_seqs + 1], slots int32 [num_seqs] and has_initial_state bool
/// [num_seqs], contiguous on `device`; returns num_seqs.
inline int64_t check_state_sequences(const char* op, const at::Tensor& cu_seqlens,
                                     const at::Tensor& slots, const at::Tensor& has_initial_state,
                                     const c10::Device& device) {
  check_contiguous(op, "cu_seqlens", cu_seqlens, at::kInt);
  check_contiguous(op, "slots", slots, at::kInt);
  check_contiguous(op, "has_initial_state", has_initial_state, at::kBool);
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, op,
              ": cu_seqlens must be [num_seqs + 1], got ", cu_seqlens.sizes());
  const int64_t num_seqs = cu_seqlens.size(0) - 1;
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == num_seqs, op, ": slots must be [", num_seqs,
              "], got ", slots.sizes());
  TORCH_CHECK(has_initial_state.dim() == 1 && has_initial_state.size(0) == num_seqs, op,
              ": has_initial_state must be [", num_seqs, "], got ", has_initial_state.sizes());
  for (const at::Tensor* t : {&cu_seqlens, &slots, &has_initial_state}) {
    TORCH_CHECK(t->device() == device, op, ": the sequence tensors must be on ", device,
                ", got ", t->device());
  }
  return num_seqs;
}

/// Checks, on the host, that cu_seqlens runs from 0 to num_tokens without decreasing and that
/// the slots are distinct and in [0, num_slots) (the CPU launchers; a CUDA kernel skips such
/// sequences instead of reading device memory on the host).
inline void check_state_sequence_values(const char* op, const at::Tensor& cu_seqlens,
                                        const at::Tensor& slots, int64_t num_tokens,
                                        int64_t num_slots) {
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t num_seqs = slots.size(0);
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == num_tokens, op, ": cu_seqlens must run from 0 to ",
              num_tokens, ", got ", cu[0], " .. ", cu[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(cu[s] <= cu[s + 1], op, ": cu_seqlens decreases at ", s);
  }
  std::vector<bool> used(num_slots, false);
  const int32_t* slot = slots.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, op, ": slot ", slot[s],
                " is outside the pool's [0, ", num_slots, ")");
    TORCH_CHECK(!used[slot[s]], op, ": slot ", slot[s], " is given to two sequences");
    used[slot[s]] = true;
  }
}

/// Checks a per-channel parameter (weight, bias, D, dt_bias): `dtype` or fp32, contiguous,
/// of `shape`, on `device`.
inline void check_ssm_param(const char* op, const char* name, const at::Tensor& t,
                            at::ScalarType dtype, at::IntArrayRef shape,
                            const c10::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype || t.scalar_type() == at::kFloat, op, ": ", name,
              " must be ", dtype, " or float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.sizes() == shape, op, ": ", name, " must be contiguous ",
              shape, ", got ", t.sizes());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), ", expected ",
              device);
}

/// Checks the arguments of ssm_causal_conv1d (contract: ssm_causal_conv1d.h); returns num_seqs.
inline int64_t check_ssm_causal_conv1d(const at::Tensor& out, const at::Tensor& input,
                                       const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias,
                                       const at::Tensor& conv_state, const at::Tensor& cu_seqlens,
                                       const at::Tensor& slots,
                                       const at::Tensor& has_initial_state) {
  constexpr const char* op = "ssm_causal_conv1d";
  check_rows(op, "input", input, 2);
  check_rows(op, "out", out, 2);
  check_like(op, "out", out, input);
  TORCH_CHECK(out.sizes() == input.sizes(), op, ": out must have the shape of input");
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": input must be float32, bfloat16 or float16, got ", dtype);
  const int64_t dim = input.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == dim && weight.size(1) >= 2 &&
                  weight.size(1) <= 16,
              op, ": weight must be [", dim, ", kernel] with 2 <= kernel <= 16, got ",
              weight.sizes());
  const int64_t kernel = weight.size(1);
  check_ssm_param(op, "weight", weight, dtype, {dim, kernel}, input.device());
  if (bias) check_ssm_param(op, "bias", *bias, dtype, {dim}, input.device());
  TORCH_CHECK(conv_state.scalar_type() == at::kFloat || conv_state.scalar_type() == dtype, op,
              ": conv_state must be float32 or ", dtype, ", got ", conv_state.scalar_type());
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.dim() == 3 &&
                  conv_state.size(1) == dim && conv_state.size(2) == kernel - 1,
              op, ": conv_state must be contiguous [num_slots, ", dim, ", ", kernel - 1,
              "], got ", conv_state.sizes());
  TORCH_CHECK(conv_state.device() == input.device(), op, ": conv_state is on ",
              conv_state.device(), ", expected ", input.device());
  return check_state_sequences(op, cu_seqlens, slots, has_initial_state, input.device());
}

/// Checks a [num_tokens, d1, d2] operand of ssm_scan: `dtype`, inner dims contiguous.
inline void check_scan_operand(const char* name, const at::Tensor& t, at::ScalarType dtype,
                               int64_t num_tokens, int64_t d1, int64_t d2,
                               const c10::Device& device) {
  constexpr const char* op = "ssm_scan";
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " has dtype ", t.scalar_type(),
              ", expected ", dtype);
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(1) == d1 && t.size(2) == d2, op,
              ": ", name, " must be [", num_tokens, ", ", d1, ", ", d2, "], got ", t.sizes());
  TORCH_CHECK((t.stride(2) == 1 || d2 == 1) && (t.stride(1) == d2 || d1 == 1), op, ": ", name,
              " must be contiguous but for its token stride");
}

/// Checks that dt_min <= dt_max (neither NaN).
inline void check_dt_limits(double dt_min, double dt_max) {
  TORCH_CHECK(dt_min <= dt_max, "ssm_scan: dt_min ", dt_min, " must be at most dt_max ", dt_max);
}

/// Checks the arguments of ssm_scan (contract: ssm_scan.h); returns num_seqs.
inline int64_t check_ssm_scan(const at::Tensor& out, const at::Tensor& x, const at::Tensor& dt,
                              const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                              const std::optional<at::Tensor>& D,
                              const std::optional<at::Tensor>& dt_bias, const at::Tensor& state,
                              const at::Tensor& cu_seqlens, const at::Tensor& slots,
                              const at::Tensor& has_initial_state) {
  constexpr const char* op = "ssm_scan";
  TORCH_CHECK(x.dim() == 3, op, ": x must be [num_tokens, heads, head_dim], got ", x.sizes());
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", dtype);
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const c10::Device device = x.device();
  check_scan_operand("x", x, dtype, tokens, heads, head_dim, device);
  check_scan_operand("out", out, dtype, tokens, heads, head_dim, device);
  TORCH_CHECK(B.dim() == 3 && B.size(1) >= 1 && heads % B.size(1) == 0, op,
              ": B must be [num_tokens, groups, state_size] with groups dividing ", heads,
              " heads, got ", B.sizes());
  const int64_t groups = B.size(1), state_size = B.size(2);
  check_scan_operand("B", B, dtype, tokens, groups, state_size, device);
  check_scan_operand("C", C, dtype, tokens, groups, state_size, device);
  TORCH_CHECK(dt.scalar_type() == dtype && dt.device() == device && dt.dim() == 2 &&
                  dt.size(0) == tokens && dt.size(1) == heads && (dt.stride(1) == 1 || heads == 1),
              op, ": dt must be ", dtype, " [", tokens, ", ", heads,
              "] contiguous but for its token stride, got ", dt.scalar_type(), " ", dt.sizes());
  check_contiguous(op, "A", A, at::kFloat);
  TORCH_CHECK((A.dim() == 1 || (A.dim() == 2 && A.size(1) == state_size)) && A.size(0) == heads &&
                  A.device() == device,
              op, ": A must be [", heads, "] or [", heads, ", ", state_size, "] on ", device,
              ", got ", A.sizes());
  if (D) check_ssm_param(op, "D", *D, dtype, {heads}, device);
  if (dt_bias) check_ssm_param(op, "dt_bias", *dt_bias, dtype, {heads}, device);
  TORCH_CHECK(state.scalar_type() == at::kFloat || state.scalar_type() == dtype, op,
              ": state must be float32 or ", dtype, ", got ", state.scalar_type());
  TORCH_CHECK(state.is_contiguous() && state.dim() == 4 && state.size(1) == heads &&
                  state.size(2) == head_dim && state.size(3) == state_size,
              op, ": state must be contiguous [num_slots, ", heads, ", ", head_dim, ", ",
              state_size, "], got ", state.sizes());
  TORCH_CHECK(state.device() == device, op, ": state is on ", state.device(), ", expected ",
              device);
  return check_state_sequences(op, cu_seqlens, slots, has_initial_state, device);
}

}  // namespace kvserve::ops
