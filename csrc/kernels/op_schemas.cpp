// The one declaration of every kvserve op (torch.ops.kvserve.*), and the C++ entry points that
// call them through the dispatcher so that callers never choose a device themselves.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels/activation/clamped_swiglu_and_mul.h"
#include "kernels/activation/gelu_tanh_and_mul.h"
#include "kernels/activation/silu_and_mul.h"
#include "kernels/attention/paged_attention.h"
#include "kernels/cache/kv_cache_copy_blocks.h"
#include "kernels/cache/kv_cache_write.h"
#include "kernels/linear/linear.h"
#include "kernels/linear/llm_int8_linear.h"
#include "kernels/linear/lora_add.h"
#include "kernels/linear/quantized_linear.h"
#include "kernels/moe/fused_moe.h"
#include "kernels/moe/fused_moe_quantized.h"
#include "kernels/moe/moe_routing.h"
#include "kernels/norm/layer_norm.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/norm/rms_norm_gated.h"
#include "kernels/rotary/rotary_embedding.h"
#include "kernels/sampling/rejection_sampling.h"
#include "kernels/sampling/sampling.h"
#include "kernels/ssm/ssm_causal_conv1d.h"
#include "kernels/ssm/ssm_scan.h"

TORCH_LIBRARY(kvserve, m) {
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()");
  m.def(
      "layer_norm(Tensor! out, Tensor input, Tensor weight, Tensor? bias, float epsilon) -> ()");
  m.def(
      "rms_norm_gated(Tensor! out, Tensor input, Tensor? gate, Tensor? weight, int group_size, "
      "float epsilon, bool norm_before_gate=False) -> ()");
  m.def(
      "ssm_causal_conv1d(Tensor! out, Tensor input, Tensor weight, Tensor? bias, "
      "Tensor(a!) conv_state, Tensor cu_seqlens, Tensor slots, Tensor has_initial_state, "
      "bool silu) -> ()");
  m.def(
      "ssm_scan(Tensor! out, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
      "Tensor? dt_bias, Tensor(a!) state, Tensor cu_seqlens, Tensor slots, "
      "Tensor has_initial_state, bool dt_softplus, float dt_min, float dt_max) -> ()");
  m.def("silu_and_mul(Tensor! out, Tensor input) -> ()");
  m.def("gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()");
  m.def("clamped_swiglu_and_mul(Tensor! out, Tensor input, float alpha, float limit) -> ()");
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("linear_prepack(Tensor weight) -> Tensor");
  m.def("linear_gather_rows(Tensor weight, Tensor ids) -> Tensor");
  m.def(
      "lora_add(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor slots, "
      "Tensor scales) -> ()");
  m.def(
      "quantized_linear(Tensor input, Tensor qweight, Tensor scales, Tensor? zeros, int group_size, "
      "Tensor? bias=None, bool quantize_input=False, Tensor? super_scales=None, "
      "Tensor? super_mins=None) -> Tensor");
  m.def(
      "llm_int8_linear(Tensor input, Tensor weight, Tensor weight_scales, float threshold, "
      "Tensor? bias=None) -> Tensor");
  m.def(
      "rotary_embedding(Tensor positions, Tensor! query, Tensor! key, int head_dim, "
      "Tensor cos_sin_cache, bool is_neox, Tensor? query_norm=None, Tensor? key_norm=None, "
      "float norm_epsilon=1e-6) -> ()");
  m.def(
      "kv_cache_write(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
      "Tensor slot_mapping, Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
  m.def(
      "kv_cache_copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
      "Tensor block_mapping) -> ()");
  m.def(
      "paged_attention(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, float scale, "
      "int sliding_window, float logit_softcap, Tensor? key_scale=None, "
      "Tensor? value_scale=None, Tensor? sinks=None) -> ()");
  m.def(
      "fused_moe(Tensor hidden, Tensor[] w13, Tensor[] w2, Tensor topk_weights, "
      "Tensor topk_ids, Tensor? w13_bias=None, Tensor? w2_bias=None, str activation='silu', "
      "float alpha=1.702, float limit=7.0) -> Tensor");
  m.def(
      "fused_moe_quantized(Tensor hidden, Tensor[] w13, Tensor[] w13_scales, Tensor[] w13_zeros, "
      "int w13_group_size, Tensor[] w2, Tensor[] w2_scales, Tensor[] w2_zeros, "
      "int w2_group_size, Tensor topk_weights, Tensor topk_ids, str activation='silu') "
      "-> Tensor");
  m.def(
      "moe_routing(Tensor router_logits, Tensor? correction_bias, int top_k, str scoring_func, "
      "int n_group, int topk_group, bool renormalize, float routed_scaling_factor) "
      "-> (Tensor, Tensor)");
  m.def(
      "sampling_filter_logits(Tensor! logits, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor min_p) -> ()");
  m.def("sampling_from_logits(Tensor logits, Tensor temperature, Tensor uniform) -> Tensor");
  m.def(
      "rejection_sample(Tensor target_probs, Tensor draft_probs, Tensor draft_token_ids, "
      "Tensor cu_num_drafts, Tensor uniform) -> (Tensor, Tensor)");
}

// Devices without a packed weight layout: linear_prepack gives an undefined tensor, and a plain
// weight's rows are an index_select.
TORCH_LIBRARY_IMPL(kvserve, CompositeExplicitAutograd, m) {
  m.impl("linear_prepack", [](const at::Tensor&) { return at::Tensor(); });
  m.impl("linear_gather_rows",
         [](const at::Tensor& weight, const at::Tensor& ids) { return weight.index_select(0, ids); });
}

namespace kvserve::ops {
namespace {

// The typed handle of kvserve::<name>, looked up once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  static const auto op = handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "kvserve::rms_norm");
  op.call(out, input, weight, epsilon);
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  static const auto op = handle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>(
      "kvserve::fused_add_rms_norm");
  op.call(input, residual, weight, epsilon);
}

void layer_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, double epsilon) {
  static const auto op =
      handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const std::optional<at::Tensor>&, double)>("kvserve::layer_norm");
  op.call(out, input, weight, bias, epsilon);
}

void rms_norm_gated(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& gate,
                    const std::optional<at::Tensor>& weight, int64_t group_size, double epsilon,
                    bool norm_before_gate) {
  static const auto op =
      handle<void(at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&, int64_t, double, bool)>(
          "kvserve::rms_norm_gated");
  op.call(out, input, gate, weight, group_size, epsilon, norm_before_gate);
}

void ssm_causal_conv1d(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::Tensor& conv_state,
                       const at::Tensor& cu_seqlens, const at::Tensor& slots,
                       const at::Tensor& has_initial_state, bool silu) {
  static const auto op =
      handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const std::optional<at::Tensor>&, at::Tensor&, const at::Tensor&,
                  const at::Tensor&, const at::Tensor&, bool)>("kvserve::ssm_causal_conv1d");
  op.call(out, input, weight, bias, conv_state, cu_seqlens, slots, has_initial_state, silu);
}

void ssm_scan(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
              const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
              const std::optional<at::Tensor>& dt_bias, at::Tensor& state,
              const at::Tensor& cu_seqlens, const at::Tensor& slots,
              const at::Tensor& has_initial_state, bool dt_softplus, double dt_min,
              double dt_max) {
  static const auto op =
      handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&, at::Tensor&, const at::Tensor&,
                  const at::Tensor&, const at::Tensor&, bool, double, double)>(
          "kvserve::ssm_scan");
  op.call(out, x, dt, A, B, C, D, dt_bias, state, cu_seqlens, slots, has_initial_state,
          dt_softplus, dt_min, dt_max);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  static const auto op = handle<void(at::Tensor&, const at::Tensor&)>("kvserve::silu_and_mul");
  op.call(out, input);
}

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
              const at::Tensor& lora_b, const at::Tensor& slots, const at::Tensor& scales) {
  static const auto op =
      handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const at::Tensor&, const at::Tensor&)>("kvserve::lora_add");
  op.call(out, x, lora_a, lora_b, slots, scales);
}

void clamped_swiglu_and_mul(at::Tensor& out, const at::Tensor& input, double alpha,
                            double limit) {
  static const auto op = handle<void(at::Tensor&, const at::Tensor&, double, double)>(
      "kvserve::clamped_swiglu_and_mul");
  op.call(out, input, alpha, limit);
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  static const auto op =
      handle<void(at::Tensor&, const at::Tensor&)>("kvserve::gelu_tanh_and_mul");
  op.call(out, input);
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  static const auto op =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
          "kvserve::linear");
  return op.call(input, weight, bias);
}

at::Tensor linear_prepack(const at::Tensor& weight) {
  static const auto op = handle<at::Tensor(const at::Tensor&)>("kvserve::linear_prepack");
  return op.call(weight);
}

at::Tensor linear_gather_rows(const at::Tensor& weight, const at::Tensor& ids) {
  static const auto op =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("kvserve::linear_gather_rows");
  return op.call(weight, ids);
}

at::Tensor llm_int8_linear(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& weight_scales, double threshold,
                           const std::optional<at::Tensor>& bias) {
  static const auto op =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                        const std::optional<at::Tensor>&)>("kvserve::llm_int8_linear");
  return op.call(input, weight, weight_scales, threshold, bias);
}

at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& qweight,
                            const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                            int64_t group_size, const std::optional<at::Tensor>& bias,
                            bool quantize_input, const std::optional<at::Tensor>& super_scales,
                            const std::optional<at::Tensor>& super_mins) {
  static const auto op =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, int64_t,
                        const std::optional<at::Tensor>&, bool,
                        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>(
          "kvserve::quantized_linear");
  return op.call(input, qweight, scales, zeros, group_size, bias, quantize_input, super_scales,
                 super_mins);
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_dim, const at::Tensor& cos_sin_cache, bool is_neox,
                      const std::optional<at::Tensor>& query_norm,
                      const std::optional<at::Tensor>& key_norm, double norm_epsilon) {
  static const auto op =
      handle<void(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, const at::Tensor&, bool,
                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double)>(
          "kvserve::rotary_embedding");
  op.call(positions, query, key, head_dim, cos_sin_cache, is_neox, query_norm, key_norm,
          norm_epsilon);
}

void kv_cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& key_scale,
                    const std::optional<at::Tensor>& value_scale) {
  static const auto op =
      handle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                  const at::Tensor&, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&)>("kvserve::kv_cache_write");
  op.call(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale);
}

void kv_cache_copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                          const at::Tensor& block_mapping) {
  static const auto op = handle<void(at::TensorList, at::TensorList, const at::Tensor&)>(
      "kvserve::kv_cache_copy_blocks");
  op.call(key_caches, value_caches, block_mapping);
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
                     int64_t sliding_window, double logit_softcap,
                     const std::optional<at::Tensor>& key_scale,
                     const std::optional<at::Tensor>& value_scale,
                     const std::optional<at::Tensor>& sinks) {
  static const auto op =
      handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                  double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&)>("kvserve::paged_attention");
  op.call(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
          sliding_window, logit_softcap, key_scale, value_scale, sinks);
}

at::Tensor fused_moe(const at::Tensor& hidden, at::TensorList w13, at::TensorList w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     const std::optional<at::Tensor>& w13_bias,
                     const std::optional<at::Tensor>& w2_bias, std::string_view activation,
                     double alpha, double limit) {
  static const auto op =
      handle<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, const at::Tensor&,
                        const at::Tensor&, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&, c10::string_view, double, double)>(
          "kvserve::fused_moe");
  return op.call(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, alpha,
                 limit);
}

at::Tensor fused_moe_quantized(const at::Tensor& hidden, at::TensorList w13,
                               at::TensorList w13_scales, at::TensorList w13_zeros,
                               int64_t w13_group_size, at::TensorList w2, at::TensorList w2_scales,
                               at::TensorList w2_zeros, int64_t w2_group_size,
                               const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                               std::string_view activation) {
  static const auto op =
      handle<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, at::TensorList, int64_t,
                        at::TensorList, at::TensorList, at::TensorList, int64_t,
                        const at::Tensor&, const at::Tensor&, c10::string_view)>(
          "kvserve::fused_moe_quantized");
  return op.call(hidden, w13, w13_scales, w13_zeros, w13_group_size, w2, w2_scales, w2_zeros,
                 w2_group_size, topk_weights, topk_ids, activation);
}

std::tuple<at::Tensor, at::Tensor> moe_routing(const at::Tensor& router_logits,
                                               const std::optional<at::Tensor>& correction_bias,
                                               int64_t top_k, std::string_view scoring_func,
                                               int64_t n_group, int64_t topk_group,
                                               bool renormalize, double routed_scaling_factor) {
  static const auto op = handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const std::optional<at::Tensor>&, int64_t, c10::string_view, int64_t,
      int64_t, bool, double)>("kvserve::moe_routing");
  return op.call(router_logits, correction_bias, top_k, scoring_func, n_group, topk_group,
                 renormalize, routed_scaling_factor);
}

void sampling_filter_logits(at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& top_k, const at::Tensor& top_p,
                            const at::Tensor& min_p) {
  static const auto op = handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&)>(
      "kvserve::sampling_filter_logits");
  op.call(logits, temperature, top_k, top_p, min_p);
}

at::Tensor sampling_from_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& uniform) {
  static const auto op =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "kvserve::sampling_from_logits");
  return op.call(logits, temperature, uniform);
}

std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& target_probs,
                                                    const at::Tensor& draft_probs,
                                                    const at::Tensor& draft_token_ids,
                                                    const at::Tensor& cu_num_drafts,
                                                    const at::Tensor& uniform) {
  static const auto op =
      handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&)>("kvserve::rejection_sample");
  return op.call(target_probs, draft_probs, draft_token_ids, cu_num_drafts, uniform);
}

}  // namespace kvserve::ops
