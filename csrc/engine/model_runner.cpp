#include "kvserve/model_runner.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "kvserve/forward_batch.h"
#include "kvserve/kv_cache.h"

namespace kvserve {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool contains(const std::vector<int64_t>& ids, int64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<CausalLM> model, int64_t max_model_len,
                         int64_t max_num_seqs, std::vector<int64_t> eos_token_ids)
    : model_(std::move(model)),
      max_model_len_(max_model_len),
      max_num_seqs_(max_num_seqs),
      eos_token_ids_(std::move(eos_token_ids)) {
  if (max_model_len_ < 2) throw std::invalid_argument("max_model_len must be >= 2");
  if (max_num_seqs_ < 1) throw std::invalid_argument("max_num_seqs must be >= 1");
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
}

std::vector<GenerationResult> ModelRunner::generate(const std::vector<GenerationRequest>& requests) {
  for (const auto& request : requests) validate(request);
  std::vector<GenerationResult> results(requests.size());
  for (size_t begin = 0; begin < requests.size(); begin += max_num_seqs_) {
    run_batch(requests, begin, std::min(requests.size(), begin + max_num_seqs_), results);
  }
  return results;
}

void ModelRunner::run_batch(const std::vector<GenerationRequest>& requests, size_t begin,
                            size_t end, std::vector<GenerationResult>& results) {
  const double start = now();
  const int64_t batch = static_cast<int64_t>(end - begin);
  int64_t max_len = 0;
  for (size_t i = begin; i < end; ++i) {
    const auto& r = requests[i];
    max_len = std::max(max_len, static_cast<int64_t>(r.prompt_token_ids.size()) + r.params.max_tokens);
  }
  max_len = std::min(max_len, max_model_len_);
  const ModelConfig& config = model_->config();
  const at::Device device = model_->device();
  std::vector<KVCache> caches = KVCache::from_model_config(
      batch, max_len, config.num_layers, config.num_kv_heads, config.head_dim, model_->dtype(), device);
  std::vector<LayerKVCache> views;
  for (const KVCache& cache : caches) views.push_back(cache.layer_view());

  std::vector<RequestRandom> randoms;
  randoms.reserve(batch);
  for (size_t i = begin; i < end; ++i) randoms.emplace_back(requests[i].params.seed);

  // Row b feeds `pending[b]` at positions [fed[b], fed[b] + pending[b].size()).
  std::vector<std::vector<int64_t>> pending(batch);
  std::vector<int64_t> fed(batch, 0);
  std::vector<int64_t> active;
  for (int64_t b = 0; b < batch; ++b) {
    pending[b] = requests[begin + b].prompt_token_ids;
    results[begin + b].start_time = start;
    active.push_back(b);
  }

  while (!active.empty()) {
    // Row b of the contiguous cache is one block of max_len tokens.
    ForwardBatchBuilder builder(max_len);
    for (int64_t b : active) {
      builder.add(pending[b], fed[b], {static_cast<int32_t>(b)});
      fed[b] += static_cast<int64_t>(pending[b].size());
    }
    const int64_t rows = static_cast<int64_t>(active.size());
    const ForwardBatch batch = builder.build(device);
    at::Tensor hidden = model_->forward(batch.input_ids, batch.positions, batch.metadata, views);
    at::Tensor logits = model_->compute_logits(hidden.index_select(0, batch.logits_indices));

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
      } else {
        pending[b].assign(1, token[i]);
        still_active.push_back(b);
      }
    }
    active.swap(still_active);
  }
}

}  // namespace kvserve
