#include "layers/attention.h"

#include <ATen/ops/empty.h>

#include <cmath>

#include "kernels/attention/paged_attention.h"
#include "kernels/cache/kv_cache_write.h"

namespace kvserve {

Attention::Attention(const ModelConfig& c, int64_t layer, const WeightMap& w,
                     const RotaryEmbedding* rotary)
    : rotary_(rotary),
      num_heads_(c.num_heads),
      num_kv_heads_(c.num_kv_heads),
      head_dim_(c.head_dim),
      sliding_window_(c.sliding_windows.empty() ? 0 : c.sliding_windows.at(layer)),
      scale_(1.0 / std::sqrt(c.query_pre_attn_scalar > 0 ? c.query_pre_attn_scalar
                                                        : static_cast<double>(c.head_dim))),
      logit_softcap_(c.attn_logit_softcap),
      shares_kv_(c.kv_source(layer) != layer) {
  const std::string p = "layers." + std::to_string(layer) + ".self_attn.";
  if (shares_kv_) {  // CLA: queries only; keys and values are the source layer's
    qkv_proj_ = Linear::load(w, p + "q_proj");
  } else {
    qkv_proj_ = Linear::load(w, p + "qkv_proj");
  }
  o_proj_ = Linear::load_row_parallel(w, p + "o_proj");
  full_width_qk_norm_ = c.qk_norm_full_width;
  if (full_width_qk_norm_ && w.communicator()->size() > 1) norm_ranks_ = w.communicator();
  if (c.qk_norm) {
    q_norm_ = RMSNorm(w.get(p + "q_norm.weight"), c.rms_norm_eps, c.norm_weight_offset);
    if (!shares_kv_) {
      k_norm_ = RMSNorm(w.get(p + "k_norm.weight"), c.rms_norm_eps, c.norm_weight_offset);
    }
  }
  if (c.attention_sinks) {
    sinks_ = w.get(p + "sinks").to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_.dim() == 1 && sinks_.size(0) == num_heads_, "layer ", layer,
                ": sinks must be [", num_heads_, "], got ", sinks_.sizes());
  }
  const int64_t outputs = (num_heads_ + (shares_kv_ ? 0 : 2 * num_kv_heads_)) * head_dim_;
  TORCH_CHECK(qkv_proj_.out_features() == outputs, "layer ", layer, ": ",
              shares_kv_ ? "q_proj" : "qkv_proj", " has ", qkv_proj_.out_features(),
              " outputs, expected ", outputs);
}

at::Tensor Attention::forward(const at::Tensor& positions, const at::Tensor& hidden,
                              const AttentionMetadata& m, const LayerKVCache& kv) const {
  const int64_t num_tokens = hidden.size(0);
  const int64_t q_width = num_heads_ * head_dim_, kv_width = num_kv_heads_ * head_dim_;
  // [T, q_width (+ 2 * kv_width)]
  at::Tensor qkv = qkv_proj_.forward(hidden, m.lora_slots);
  at::Tensor q = qkv.narrow(1, 0, q_width);
  // Qwen3, Gemma 3: an RMSNorm over each head before RoPE, in the rotary op's pass; OLMo 2: one
  // over all heads at once, before it.
  const bool per_head = q_norm_.defined() && !full_width_qk_norm_;
  if (full_width_qk_norm_) q.copy_(full_width_norm(q_norm_, q));
  const RMSNorm* q_norm = per_head ? &q_norm_ : nullptr;
  if (shares_kv_) {  // the source layer wrote this step's K/V already
    at::Tensor no_key = at::empty({num_tokens, 0}, q.options());
    if (rotary_) rotary_->apply(positions, q, no_key, q_norm);
  } else {
    at::Tensor k = qkv.narrow(1, q_width, kv_width);
    at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width);
    if (full_width_qk_norm_) k.copy_(full_width_norm(k_norm_, k));
    if (rotary_) rotary_->apply(positions, q, k, q_norm, per_head ? &k_norm_ : nullptr);
    at::Tensor key_cache = kv.key, value_cache = kv.value;
    ops::kv_cache_write(k.view({num_tokens, num_kv_heads_, head_dim_}),
                        v.view({num_tokens, num_kv_heads_, head_dim_}), key_cache, value_cache,
                        m.slots(kv.group), kv.key_scales(), kv.value_scales());
  }
  at::Tensor out = at::empty({num_tokens, num_heads_, head_dim_}, hidden.options());
  ops::paged_attention(out, q.view({num_tokens, num_heads_, head_dim_}), kv.key, kv.value,
                       m.query_start_loc, m.seq_lens, m.tables(kv.group), scale_, sliding_window_,
                       logit_softcap_, kv.key_scales(), kv.value_scales(),
                       sinks_.defined() ? std::optional<at::Tensor>(sinks_) : std::nullopt);
  return o_proj_.forward(out.view({num_tokens, q_width}), m.lora_slots);
}

at::Tensor Attention::full_width_norm(const RMSNorm& norm, const at::Tensor& x) const {
  if (!norm_ranks_) return norm.forward(x);
  // mean(x^2) over the whole width: each rank's sums, summed, over the ranks' widths. With key
  // heads replicated (fewer than ranks) each is counted as often in both, so the mean holds.
  const at::Tensor x32 = x.to(at::kFloat);
  at::Tensor sums = x32.square().sum(1, /*keepdim=*/true);
  norm_ranks_->all_reduce_(sums);
  const double width = static_cast<double>(x.size(1) * norm_ranks_->size());
  const at::Tensor normed = x32 * sums.div_(width).add_(norm.epsilon()).rsqrt_();
  const at::Tensor& weight = norm.weight();
  if (weight.scalar_type() == at::kFloat) return (normed * weight).to(x.scalar_type());
  return normed.to(x.scalar_type()) * weight;  // rounded, then weighted, as rms_norm
}

int64_t Attention::weight_bytes() const {
  return qkv_proj_.weight_bytes() + o_proj_.weight_bytes() + q_norm_.weight_bytes() +
         k_norm_.weight_bytes() + (sinks_.defined() ? sinks_.nbytes() : 0);
}

}  // namespace kvserve
