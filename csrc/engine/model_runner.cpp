#include "kvserve/model_runner.h"

#include <algorithm>
#include <stdexcept>

#include "kvserve/forward_batch.h"
#include "engine/engine_helpers.h"

namespace kvserve {
namespace {

using engine_helpers::ceil_div;
using engine_helpers::contains;
using engine_helpers::now;

PagedKVCache make_kv_cache(const CausalLM& model, int64_t max_model_len, int64_t max_num_seqs,
                           const KVCacheConfig& config) {
  if (max_model_len < 2) throw std::invalid_argument("max_model_len must be >= 2");
  if (max_num_seqs < 1) throw std::invalid_argument("max_num_seqs must be >= 1");
  if (config.block_size < 1) throw std::invalid_argument("block_size must be >= 1");
  if (config.num_blocks < 0) throw std::invalid_argument("num_blocks must be >= 0");
  const int64_t num_blocks = config.num_blocks > 0
                                 ? config.num_blocks
                                 : max_num_seqs * ceil_div(max_model_len, config.block_size) + 1;
  const ModelConfig& c = model.config();
  return PagedKVCache(c.num_layers, num_blocks, config.block_size, c.num_kv_heads, c.head_dim,
                      model.dtype(), model.device());
}

std::vector<int32_t> to_int32(const std::vector<int64_t>& tokens) {
  return std::vector<int32_t>(tokens.begin(), tokens.end());
}

}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<CausalLM> model, int64_t max_model_len,
                         int64_t max_num_seqs, std::vector<int64_t> eos_token_ids,
                         KVCacheConfig cache_config)
    : model_(std::move(model)),
      max_model_len_(max_model_len),
      max_num_seqs_(max_num_seqs),
      eos_token_ids_(std::move(eos_token_ids)),
      kv_cache_(make_kv_cache(*model_, max_model_len, max_num_seqs, cache_config)),
      block_manager_(kv_cache_.num_blocks(), cache_config.block_size,
                     cache_config.enable_prefix_caching) {}

int64_t ModelRunner::full_length(const GenerationRequest& r) const {
  return std::min(static_cast<int64_t>(r.prompt_token_ids.size()) + r.params.max_tokens,
                  max_model_len_);
}

void ModelRunner::validate(const GenerationRequest& request) const {
  const auto& prompt = request.prompt_token_ids;
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (static_cast<int64_t>(prompt.size()) >= max_model_len_) {
    throw std::invalid_argument("the prompt has " + std::to_string(prompt.size()) +
                                " tokens; max_model_len is " + std::to_string(max_model_len_) +
                                ", which leaves no room to generate");
  }
  const int64_t vocab = model_->config().vocab_size;
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab) {
      throw std::invalid_argument("token id " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  request.params.validate();
  const int64_t blocks = ceil_div(full_length(request), block_manager_.block_size());
  if (blocks > block_manager_.num_usable_blocks()) {
    throw std::invalid_argument(
        "the request needs " + std::to_string(blocks) + " KV blocks (prompt + max_tokens = " +
        std::to_string(full_length(request)) + " tokens) but the cache has only " +
        std::to_string(block_manager_.num_usable_blocks()));
  }
}

size_t ModelRunner::batch_end(const std::vector<GenerationRequest>& requests,
                              size_t begin) const {
  // Admit while every admitted request could grow to its full length without running out of
  // blocks (this runner does not preempt). Prefix hits would need fewer; this bound ignores them.
  int64_t blocks = 0;
  size_t end = begin;
  while (end < requests.size() && static_cast<int64_t>(end - begin) < max_num_seqs_) {
    blocks += ceil_div(full_length(requests[end]), block_manager_.block_size());
    if (end > begin && blocks > block_manager_.num_free_blocks()) break;
    ++end;
  }
  return end;
}

std::vector<GenerationResult> ModelRunner::generate(const std::vector<GenerationRequest>& requests) {
  for (const auto& request : requests) validate(request);
  std::vector<GenerationResult> results(requests.size());
  for (size_t begin = 0; begin < requests.size();) {
    const size_t end = batch_end(requests, begin);
    run_batch(requests, begin, end, results);
    begin = end;
  }
  return results;
}

void ModelRunner::run_batch(const std::vector<GenerationRequest>& requests, size_t begin,
                            size_t end, std::vector<GenerationResult>& results) {
  const double start = now();
  const int64_t batch = static_cast<int64_t>(end - begin);
  const at::Device device = model_->device();

  std::vector<RequestRandom> randoms;
  randoms.reserve(batch);
  for (size_t i = begin; i < end; ++i) randoms.emplace_back(requests[i].params.seed);

  // Row b is sequence seq_ids[b]; it feeds `pending[b]` at positions [fed[b], fed[b] + size).
  // Its prompt blocks count as computed as soon as they are allocated: the whole prompt is
  // written by the first forward, before any attention of that forward reads the cache, so a
  // later row of the same batch may already reuse them (prefix caching within a batch).
  std::vector<int64_t> seq_ids(batch);
  std::vector<std::vector<int64_t>> pending(batch);
  std::vector<int64_t> fed(batch, 0);
  std::vector<int64_t> active;
  for (int64_t b = 0; b < batch; ++b) {
    const auto& prompt = requests[begin + b].prompt_token_ids;
    seq_ids[b] = next_seq_id_++;
    const int64_t cached = block_manager_.allocate(seq_ids[b], to_int32(prompt));
    block_manager_.mark_computed(seq_ids[b], static_cast<int64_t>(prompt.size()));
    pending[b].assign(prompt.begin() + cached, prompt.end());
    fed[b] = cached;
    results[begin + b].start_time = start;
    results[begin + b].num_cached_tokens = cached;
    active.push_back(b);
  }

  try {
    while (!active.empty()) {
      ForwardBatchBuilder builder(block_manager_.block_size());
      for (int64_t b : active) {
        builder.add(pending[b], fed[b], block_manager_.block_table(seq_ids[b]));
        fed[b] += static_cast<int64_t>(pending[b].size());
      }
      const int64_t rows = static_cast<int64_t>(active.size());
      const ForwardBatch fb = builder.build(device);
      at::Tensor hidden =
          model_->forward(fb.input_ids, fb.positions, fb.metadata, kv_cache_.layers());
      at::Tensor logits = model_->compute_logits(hidden.index_select(0, fb.logits_indices));

      std::vector<const SamplingParams*> params;
      std::vector<RequestRandom*> streams;
      for (int64_t b : active) {
        params.push_back(&requests[begin + b].params);
        streams.push_back(&randoms[b]);
      }
      at::Tensor tokens = sampler_.sample(logits, params, streams);
      const int64_t* token = tokens.data_ptr<int64_t>();
      const double t = now();

      std::vector<int64_t> still_active;
      std::vector<std::pair<int32_t, int32_t>> copies;
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t b = active[i];
        const SamplingParams& p = requests[begin + b].params;
        GenerationResult& result = results[begin + b];
        result.token_ids.push_back(token[i]);
        if (result.token_ids.size() == 1) result.first_token_time = t;
        const int64_t total = fed[b] + 1;  // tokens in the sequence including this one
        if ((!p.ignore_eos && contains(eos_token_ids_, token[i])) ||
            contains(p.stop_token_ids, token[i])) {
          result.finish_reason = "stop";
        } else if (static_cast<int64_t>(result.token_ids.size()) >= p.max_tokens ||
                   total >= max_model_len_) {
          result.finish_reason = "length";
        }
        if (!result.finish_reason.empty()) {
          result.finish_time = t;
          block_manager_.free(seq_ids[b]);
          continue;
        }
        block_manager_.mark_computed(seq_ids[b], fed[b]);
        // A slot for the new token, whose K/V the next forward writes (copy-on-write first if
        // its block is shared).
        for (const BlockCopy& c : block_manager_.append_slots(seq_ids[b], {static_cast<int32_t>(token[i])})) {
          copies.emplace_back(c.src, c.dst);
        }
        pending[b].assign(1, token[i]);
        still_active.push_back(b);
      }
      kv_cache_.copy_blocks(copies);
      active.swap(still_active);
    }
  } catch (...) {
    // Leave the pool whole: drop this batch's sequences and whatever they cached.
    for (int64_t b : active) {
      if (block_manager_.has_sequence(seq_ids[b])) block_manager_.free(seq_ids[b]);
    }
    block_manager_.reset_prefix_cache();
    throw;
  }
}

}  // namespace kvserve
