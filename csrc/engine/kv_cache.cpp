#include "kvserve/kv_cache.h"

#include <ATen/ops/empty.h>

#include <stdexcept>
#include <string>

#include "kvserve/forward_batch.h"

namespace kvserve {

KVCache::KVCache(int64_t max_batch_size, int64_t max_seq_len, int64_t num_kv_heads,
                 int64_t head_dim, at::ScalarType dtype, at::Device device) {
  if (max_batch_size <= 0 || max_seq_len <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    throw std::invalid_argument("KVCache: max_batch_size, max_seq_len, num_kv_heads and head_dim "
                                "must all be positive");
  }
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  key_ = at::empty({max_batch_size, max_seq_len, num_kv_heads, head_dim}, options);
  value_ = at::empty({max_batch_size, max_seq_len, num_kv_heads, head_dim}, options);
  if (is_quantized_kv_dtype(dtype)) {
    const auto scale_options = options.dtype(at::kFloat);
    key_scale_ = at::empty({max_batch_size, max_seq_len, num_kv_heads}, scale_options);
    value_scale_ = at::empty({max_batch_size, max_seq_len, num_kv_heads}, scale_options);
  }
  seq_lens_.assign(max_batch_size, 0);
}

KVCache::KVCache(int64_t max_batch_size, int64_t max_seq_len, const KVCacheLayout& layout,
                 at::ScalarType dtype, at::Device device)
    : KVCache(max_batch_size, max_seq_len, layout.num_kv_heads, layout.head_dim, dtype, device) {
  layout.validate();
  if (layout.latent) {
    value_ = key_;
    value_scale_ = key_scale_;
  } else if (layout.value_head_dim != layout.head_dim) {
    value_ = at::empty({max_batch_size, max_seq_len, layout.num_kv_heads, layout.value_head_dim},
                       key_.options());
  }
}

std::vector<KVCache> KVCache::for_model(int64_t max_batch_size, int64_t max_seq_len,
                                        const ModelConfig& config, at::ScalarType dtype,
                                        at::Device device) {
  const KVCacheLayout layout = KVCacheLayout::for_model(config);
  std::vector<KVCache> caches;
  caches.reserve(layout.num_layers);
  for (int64_t i = 0; i < layout.num_layers; ++i) {
    caches.emplace_back(max_batch_size, max_seq_len, layout, dtype, device);
  }
  return caches;
}

std::vector<KVCache> KVCache::from_model_config(int64_t max_batch_size, int64_t max_seq_len,
                                                int64_t num_layers, int64_t num_kv_heads,
                                                int64_t head_dim, at::ScalarType dtype,
                                                at::Device device) {
  std::vector<KVCache> caches;
  caches.reserve(num_layers);
  for (int64_t i = 0; i < num_layers; ++i) {
    caches.emplace_back(max_batch_size, max_seq_len, num_kv_heads, head_dim, dtype, device);
  }
  return caches;
}

void KVCache::reset() { std::fill(seq_lens_.begin(), seq_lens_.end(), 0); }

void KVCache::advance(int64_t row, int64_t num_tokens) {
  if (seq_lens_.at(row) + num_tokens > max_seq_len()) {
    throw std::out_of_range("KVCache: row " + std::to_string(row) + " would hold " +
                            std::to_string(seq_lens_[row] + num_tokens) +
                            " tokens, max_seq_len is " + std::to_string(max_seq_len()));
  }
  seq_lens_[row] += num_tokens;
}

at::Tensor forward_with_kv_cache(CausalLM& model, const at::Tensor& input_ids,
                                 const std::vector<KVCache*>& caches) {
  if (input_ids.dim() != 2) throw std::invalid_argument("input_ids must be [batch, seq]");
  if (model.config().num_ssm_layers() > 0) {
    throw std::invalid_argument("a model with state-space layers (" + model.config().architecture +
                                ") runs on the paged engine (kvserve.LLM), not on KVCache");
  }
  const int64_t num_kv_layers = model.config().num_kv_layers();
  if (caches.empty() || caches.size() != static_cast<size_t>(num_kv_layers)) {
    throw std::invalid_argument("need one KVCache per layer that writes K/V (" +
                                std::to_string(num_kv_layers) + ")");
  }
  const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
  const KVCache& first = *caches.front();
  if (batch > first.max_batch_size()) {
    throw std::invalid_argument("batch of " + std::to_string(batch) + " exceeds max_batch_size " +
                                std::to_string(first.max_batch_size()));
  }
  ForwardBatchBuilder builder(first.max_seq_len());  // row b is one block of max_seq_len tokens
  const at::Tensor ids = input_ids.to(at::kCPU, at::kLong).contiguous();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* row = ids.data_ptr<int64_t>() + b * seq;
    try {
      builder.add(std::vector<int64_t>(row, row + seq), first.seq_len(b), {static_cast<int32_t>(b)});
    } catch (const std::out_of_range&) {
      throw std::out_of_range("row " + std::to_string(b) + " would exceed max_seq_len " +
                              std::to_string(first.max_seq_len()));
    }
  }
  const ForwardBatch fb = builder.build(first.key().device());
  std::vector<LayerKVCache> views;
  for (const KVCache* cache : caches) views.push_back(cache->layer_view());
  at::Tensor hidden = model.forward(fb.input_ids, fb.positions, fb.metadata, views);
  at::Tensor logits = model.compute_logits(hidden).view({batch, seq, -1});
  for (KVCache* cache : caches) {
    for (int64_t b = 0; b < batch; ++b) cache->advance(b, seq);
  }
  return logits;
}

}  // namespace kvserve
