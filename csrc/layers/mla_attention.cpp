#include "layers/mla_attention.h"

#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kernels/attention/paged_attention.h"
#include "kernels/cache/kv_cache_write.h"

namespace kvserve {
namespace {

// The latents' RMSNorms (q_a_layernorm, kv_a_layernorm) use 1e-6 whatever the config's
// rms_norm_eps, as DeepSeek's reference code and transformers' DeepseekV2/V3 do.
constexpr double kLatentNormEpsilon = 1e-6;

at::Tensor host_tensor(const std::vector<int32_t>& v) {
  return at::from_blob(const_cast<int32_t*>(v.data()), {static_cast<int64_t>(v.size())}, at::kInt)
      .clone();
}

at::Tensor host_tensor(const std::vector<int64_t>& v) {
  return at::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())},
                       at::kLong)
      .clone();
}

// q_proj / q_b_proj rows [H * (nope + rope), in] reordered to every head's nope rows, then every
// head's rope rows: the rotary op then sees the rope parts as one [T, H * rope] run per row.
at::Tensor nope_then_rope(const at::Tensor& w, int64_t heads, int64_t nope, int64_t rope) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == heads * (nope + rope),
              "MLA: the query projection must have ", heads * (nope + rope), " outputs, got ",
              w.sizes());
  const at::Tensor per_head = w.view({heads, nope + rope, w.size(1)});
  return at::cat({per_head.narrow(1, 0, nope).reshape({heads * nope, w.size(1)}),
                  per_head.narrow(1, nope, rope).reshape({heads * rope, w.size(1)})});
}

}  // namespace

MLABatchPlan MLABatchPlan::make(const AttentionMetadata& m, const MLAConfig& mla,
                                int64_t block_size, const std::string& path) {
  if (path != "auto" && path != "absorbed" && path != "expanded") {
    throw std::invalid_argument("MLA attention path must be auto, absorbed or expanded, got '" +
                                path + "'");
  }
  // The plan reads the batch on the host: the builder's copies when the metadata has them (no
  // wait for the device, nothing read inside a CUDA graph capture), else the device tensors.
  auto on_host = [](const at::Tensor& host, const at::Tensor& device) {
    return host.defined() ? host : device.cpu();
  };
  const at::Tensor qsl_t = on_host(m.host_query_start_loc, m.query_start_loc);
  const at::Tensor lens_t = on_host(m.host_seq_lens, m.seq_lens);
  const int32_t* qsl = qsl_t.data_ptr<int32_t>();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int64_t num_seqs = lens_t.numel();
  const int64_t L = mla.kv_lora_rank, R = mla.qk_rope_head_dim, N = mla.qk_nope_head_dim,
                V = mla.v_head_dim;
  std::vector<bool> absorbed(num_seqs);
  bool all_absorbed = true, all_expanded = true;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q = qsl[b + 1] - qsl[b], ctx = lens[b];
    // Multiply-adds per head (see mla_attention.h). One query token is absorbed whatever its
    // context: from a context of 2 on that form is the cheaper one, and at 1 (a one-token
    // prompt) the two are 2 L - N - V multiply-adds apart. So every decode batch is one
    // absorbed part viewing the batch's own metadata, whatever its lengths: a CUDA graph
    // captured for one replays for all.
    const int64_t absorbed_cost = q * ctx * (2 * L + R) + q * (N * L + L * V);
    const int64_t expanded_cost = ctx * L * (N + V) + q * ctx * (N + R + V);
    absorbed[b] = path == "absorbed" ||
                  (path == "auto" && (q == 1 || absorbed_cost <= expanded_cost));
    if (q == 0) continue;
    all_absorbed = all_absorbed && absorbed[b];
    all_expanded = all_expanded && !absorbed[b];
  }
  const int64_t num_tokens = qsl[num_seqs];
  MLABatchPlan plan;
  if (all_absorbed) {
    plan.absorbed = {at::Tensor(), m.query_start_loc, m.seq_lens, m.block_tables, at::Tensor(),
                     num_tokens};
    return plan;
  }
  const at::Tensor tables_t = on_host(m.host_block_tables, m.block_tables).contiguous();
  const int32_t* tables = tables_t.data_ptr<int32_t>();
  const int64_t width = tables_t.size(1);
  // The parts' own metadata; an expanded sequence's table indexes the blocks gathered for it.
  std::vector<int64_t> tokens[2], gather;
  std::vector<int32_t> starts[2] = {{0}, {0}}, seq_lens[2], expanded_tables;
  std::vector<int64_t> absorbed_rows, expanded_blocks;
  int64_t max_blocks = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q = qsl[b + 1] - qsl[b];
    if (q == 0) continue;
    const int part = absorbed[b] ? 0 : 1;
    for (int64_t t = qsl[b]; t < qsl[b + 1]; ++t) tokens[part].push_back(t);
    starts[part].push_back(starts[part].back() + static_cast<int32_t>(q));
    seq_lens[part].push_back(lens[b]);
    if (part == 0) {
      absorbed_rows.push_back(b);
    } else {
      const int64_t blocks = (lens[b] + block_size - 1) / block_size;
      expanded_blocks.push_back(blocks);
      max_blocks = std::max(max_blocks, blocks);
      for (int64_t i = 0; i < blocks; ++i) gather.push_back(tables[b * width + i]);
    }
  }
  int64_t next = 0;
  for (int64_t blocks : expanded_blocks) {
    for (int64_t i = 0; i < max_blocks; ++i) {
      expanded_tables.push_back(i < blocks ? static_cast<int32_t>(next + i) : 0);
    }
    next += blocks;
  }
  const at::Device device = m.query_start_loc.device();
  auto part = [&](int p) {
    Part out;
    out.num_tokens = static_cast<int64_t>(tokens[p].size());
    if (out.num_tokens == 0) return out;
    out.token_index = all_expanded ? at::Tensor() : host_tensor(tokens[p]).to(device);
    out.query_start_loc = host_tensor(starts[p]).to(device);
    out.seq_lens = host_tensor(seq_lens[p]).to(device);
    return out;
  };
  plan.absorbed = part(0);
  if (!plan.absorbed.empty()) {
    plan.absorbed.block_tables =
        m.block_tables.index_select(0, host_tensor(absorbed_rows).to(device));
  }
  plan.expanded = part(1);
  if (!plan.expanded.empty()) {
    plan.expanded.block_tables = host_tensor(expanded_tables).view({-1, max_blocks}).to(device);
    plan.expanded.gather_blocks = host_tensor(gather).to(device);
  }
  return plan;
}

MLAAttention::MLAAttention(const ModelConfig& c, int64_t layer, const WeightMap& w,
                           const RotaryEmbedding* rotary, double scale)
    : mla_(c.mla), num_heads_(c.num_heads), scale_(scale), rotary_(rotary) {
  const std::string p = "layers." + std::to_string(layer) + ".self_attn.";
  const int64_t H = num_heads_, N = mla_.qk_nope_head_dim, R = mla_.qk_rope_head_dim,
                L = mla_.kv_lora_rank, V = mla_.v_head_dim;
  const at::Tensor kv_a = w.get(p + "kv_a_proj_with_mqa.weight");
  TORCH_CHECK(kv_a.dim() == 2 && kv_a.size(0) == L + R, "layer ", layer,
              ": kv_a_proj_with_mqa must have kv_lora_rank + qk_rope_head_dim = ", L + R,
              " outputs, got ", kv_a.sizes());
  const at::Tensor kv_a_bias = w.get_optional(p + "kv_a_proj_with_mqa.bias");
  // The projections that read the hidden state run as one GEMM.
  at::Tensor q_in, q_in_bias;
  if (mla_.q_lora_rank > 0) {
    q_in = w.get(p + "q_a_proj.weight");
    q_in_bias = w.get_optional(p + "q_a_proj.bias");
    q_a_layernorm_ = RMSNorm(w.get(p + "q_a_layernorm.weight"), kLatentNormEpsilon);
    q_b_proj_ = Linear(nope_then_rope(w.get(p + "q_b_proj.weight"), H, N, R), at::Tensor());
  } else {
    q_in = nope_then_rope(w.get(p + "q_proj.weight"), H, N, R);
  }
  at::Tensor fused_bias;
  if (q_in_bias.defined() || kv_a_bias.defined()) {
    auto or_zeros = [](const at::Tensor& b, int64_t n, const at::Tensor& like) {
      return b.defined() ? b : at::zeros({n}, like.options());
    };
    fused_bias = at::cat({or_zeros(q_in_bias, q_in.size(0), q_in), or_zeros(kv_a_bias, L + R, kv_a)});
  }
  q_a_kv_a_proj_ = Linear(at::cat({q_in, kv_a}), fused_bias);
  kv_a_layernorm_ = RMSNorm(w.get(p + "kv_a_layernorm.weight"), kLatentNormEpsilon);
  const at::Tensor kv_b = w.get(p + "kv_b_proj.weight");
  TORCH_CHECK(kv_b.dim() == 2 && kv_b.size(0) == H * (N + V) && kv_b.size(1) == L, "layer ",
              layer, ": kv_b_proj must be [", H * (N + V), ", ", L, "], got ", kv_b.sizes());
  // kv_b_proj held once, split per head into its key and value halves: both forms read them. In
  // fp32 whatever the model's dtype: ATen's bf16 bmm on a CPU without bf16 instructions runs
  // ~30x slower than its fp32 one (14.6 vs 0.4 ms for 8 decode tokens of 16 heads here), and the
  // halves are small (kv_lora_rank x heads x (nope + v) per layer).
  const at::Tensor per_head = kv_b.view({H, N + V, L}).to(at::kFloat);
  w_uk_ = per_head.narrow(1, 0, N).contiguous();  // [H, N, L]
  w_uv_ = per_head.narrow(1, N, V).contiguous();  // [H, V, L]
  o_proj_ = Linear::load_row_parallel(w, p + "o_proj");  // a rank's heads: summed over ranks
  TORCH_CHECK(o_proj_.in_features() == H * V, "layer ", layer, ": o_proj must read ", H * V,
              " features, got ", o_proj_.in_features());
}

at::Tensor MLAAttention::forward(const at::Tensor& positions, const at::Tensor& hidden,
                                 const AttentionMetadata& m, const LayerKVCache& kv,
                                 const MLABatchPlan& plan) const {
  const int64_t T = hidden.size(0), H = num_heads_, N = mla_.qk_nope_head_dim,
                R = mla_.qk_rope_head_dim, L = mla_.kv_lora_rank, V = mla_.v_head_dim;
  const at::Tensor fused = q_a_kv_a_proj_.forward(hidden);  // [T, q_in + L + R]
  const int64_t q_in = fused.size(1) - L - R;
  const at::Tensor q = mla_.q_lora_rank > 0
                           ? q_b_proj_.forward(q_a_layernorm_.forward(fused.narrow(1, 0, q_in)))
                           : fused.narrow(1, 0, q_in);  // [T, H * N | H * R]
  at::Tensor q_rope = q.narrow(1, H * N, H * R);
  at::Tensor k_rope = fused.narrow(1, q_in + L, R);
  rotary_->apply(positions, q_rope, k_rope);

  // This step's latents: [normalized compressed KV | rotated shared key].
  const at::Tensor entry =
      at::cat({kv_a_layernorm_.forward(fused.narrow(1, q_in, L)), k_rope}, 1).view({T, 1, L + R});
  at::Tensor cache = kv.key;  // [num_blocks, block_size, 1, L + R]; kv.value is the same tensor
  ops::kv_cache_write(entry, entry, cache, cache, m.slot_mapping, kv.key_scales(),
                      kv.key_scales());

  const at::Tensor q_nope3 = q.narrow(1, 0, H * N).view({T, H, N});
  const at::Tensor q_rope3 = q_rope.view({T, H, R});
  auto select = [](const at::Tensor& x, const MLABatchPlan::Part& part) {
    return part.token_index.defined() ? x.index_select(0, part.token_index) : x;
  };
  at::Tensor out;  // [T, H, V]
  if (plan.expanded.empty()) {
    out = attend_absorbed(q_nope3, q_rope3, kv, plan.absorbed);
  } else if (plan.absorbed.empty()) {
    out = attend_expanded(q_nope3, q_rope3, kv, plan.expanded);
  } else {
    out = at::empty({T, H, V}, hidden.options());
    for (const auto* part : {&plan.absorbed, &plan.expanded}) {
      const at::Tensor qn = select(q_nope3, *part), qr = select(q_rope3, *part);
      out.index_copy_(0, part->token_index,
                      part == &plan.absorbed ? attend_absorbed(qn, qr, kv, *part)
                                             : attend_expanded(qn, qr, kv, *part));
    }
  }
  return o_proj_.forward(out.view({T, H * V}));
}

at::Tensor MLAAttention::attend_absorbed(const at::Tensor& q_nope, const at::Tensor& q_rope,
                                         const LayerKVCache& kv,
                                         const MLABatchPlan::Part& part) const {
  const int64_t n = q_nope.size(0), H = num_heads_, L = mla_.kv_lora_rank,
                R = mla_.qk_rope_head_dim;
  // The query in latent space: q_nope W_UK per head, then the rope part.
  at::Tensor query = at::empty({n, H, L + R}, q_nope.options());
  query.narrow(2, 0, L).copy_(at::bmm(q_nope.transpose(0, 1).to(at::kFloat), w_uk_).transpose(0, 1));
  query.narrow(2, L, R).copy_(q_rope);
  at::Tensor latent_out = at::empty({n, H, L}, q_nope.options());
  ops::paged_attention(latent_out, query, kv.key, kv.key, part.query_start_loc, part.seq_lens,
                       part.block_tables, scale_, 0, 0.0, kv.key_scales(), kv.key_scales());
  // Values: the attended latent through W_UV per head.
  return at::bmm(latent_out.transpose(0, 1).to(at::kFloat), w_uv_.transpose(1, 2))
      .transpose(0, 1)
      .to(q_nope.scalar_type())
      .contiguous();
}

at::Tensor MLAAttention::attend_expanded(const at::Tensor& q_nope, const at::Tensor& q_rope,
                                         const LayerKVCache& kv,
                                         const MLABatchPlan::Part& part) const {
  const int64_t n = q_nope.size(0), H = num_heads_, N = mla_.qk_nope_head_dim,
                R = mla_.qk_rope_head_dim, L = mla_.kv_lora_rank, V = mla_.v_head_dim;
  at::Tensor blocks = kv.key.index_select(0, part.gather_blocks);  // [nb, bs, 1, L + R]
  if (kv.key_scale.defined()) {  // an int8 / fp8 cache: entries times their token's scale
    blocks = blocks.to(at::kFloat)
                 .mul_(kv.key_scale.index_select(0, part.gather_blocks).unsqueeze(-1))
                 .to(q_nope.scalar_type());
  }
  const int64_t nb = blocks.size(0), bs = blocks.size(1);
  const at::Tensor flat = blocks.view({nb * bs, L + R});
  // Every context slot's keys and values (slots past a context hold whatever the block held;
  // attention never reads them).
  const at::Tensor latent = flat.narrow(1, 0, L).to(at::kFloat);
  at::Tensor keys = at::empty({nb, bs, H, N + R}, q_nope.options());
  keys.narrow(3, 0, N).copy_(at::linear(latent, w_uk_.view({H * N, L})).view({nb, bs, H, N}));
  keys.narrow(3, N, R).copy_(flat.narrow(1, L, R).view({nb, bs, 1, R}).expand({nb, bs, H, R}));
  const at::Tensor values =
      at::linear(latent, w_uv_.view({H * V, L})).to(q_nope.scalar_type()).view({nb, bs, H, V});
  const at::Tensor query = at::cat({q_nope, q_rope}, 2);  // [n, H, N + R]
  at::Tensor out = at::empty({n, H, V}, q_nope.options());
  ops::paged_attention(out, query, keys, values, part.query_start_loc, part.seq_lens,
                       part.block_tables, scale_, 0, 0.0);
  return out;
}

int64_t MLAAttention::weight_bytes() const {
  return q_a_kv_a_proj_.weight_bytes() + q_a_layernorm_.weight_bytes() +
         q_b_proj_.weight_bytes() + kv_a_layernorm_.weight_bytes() +
         static_cast<int64_t>(w_uk_.nbytes() + w_uv_.nbytes()) + o_proj_.weight_bytes();
}

}  // namespace kvserve
