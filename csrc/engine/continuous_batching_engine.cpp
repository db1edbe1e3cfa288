#include "kvserve/continuous_batching_engine.h"

#include <ATen/ops/tensor.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

#include "kvserve/forward_batch.h"
#include "engine/engine_helpers.h"

namespace kvserve {
namespace {

using engine_helpers::ceil_div;
using engine_helpers::contains;
using engine_helpers::now;

EngineConfig resolved(const CausalLM& model, EngineConfig config) {
  const int64_t limit = model.config().max_position_embeddings;
  if (config.max_model_len == 0) config.max_model_len = limit;
  if (config.max_model_len < 2 || config.max_model_len > limit) {
    throw std::invalid_argument("max_model_len must be in [2, " + std::to_string(limit) +
                                "], got " + std::to_string(config.max_model_len));
  }
  if (config.block_size < 1) throw std::invalid_argument("block_size must be >= 1");
  if (config.num_blocks < 2) {
    throw std::invalid_argument("num_blocks must be >= 2 (block 0 is the null block)");
  }
  SchedulerConfig{config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len}
      .validate();
  return config;
}

}  // namespace

double RequestMetrics::time_per_output_token() const {
  return num_generated_tokens > 1
             ? (last_token_time - first_token_time) / static_cast<double>(num_generated_tokens - 1)
             : 0.0;
}

ContinuousBatchingEngine::ContinuousBatchingEngine(std::shared_ptr<CausalLM> model,
                                                   EngineConfig config)
    : model_(std::move(model)),
      config_(resolved(*model_, std::move(config))),
      kv_cache_(model_->config().num_layers, config_.num_blocks, config_.block_size,
                model_->config().num_kv_heads, model_->config().head_dim, model_->dtype(),
                model_->device()),
      block_manager_(config_.num_blocks, config_.block_size, config_.enable_prefix_caching),
      scheduler_(SchedulerConfig{config_.max_num_seqs, config_.max_num_batched_tokens,
                                 config_.max_model_len},
                 block_manager_) {}

void ContinuousBatchingEngine::validate(const std::string& request_id,
                                        const std::vector<int64_t>& prompt,
                                        const SamplingParams& params) const {
  if (request_id.empty()) throw std::invalid_argument("the request id is empty");
  if (requests_.count(request_id)) {
    throw std::invalid_argument("request id '" + request_id + "' is already in use");
  }
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  const int64_t vocab = model_->config().vocab_size;
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab) {
      throw std::invalid_argument("token id " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  params.validate();
  if (params.logprobs && *params.logprobs > vocab) {
    throw std::invalid_argument("logprobs must be at most the vocabulary size " +
                                std::to_string(vocab) + ", got " +
                                std::to_string(*params.logprobs));
  }
  const int64_t len = static_cast<int64_t>(prompt.size());
  if (len + params.max_tokens > config_.max_model_len) {
    throw std::invalid_argument("the prompt (" + std::to_string(len) + " tokens) + max_tokens (" +
                                std::to_string(params.max_tokens) + ") exceeds max_model_len " +
                                std::to_string(config_.max_model_len));
  }
  // All n samples at full length: shared prompt blocks plus each sample's own blocks (one more
  // for its copy of the last, partly filled prompt block).
  const int64_t bs = config_.block_size;
  const int64_t blocks = ceil_div(len + params.max_tokens, bs) +
                         (params.n - 1) * (ceil_div(params.max_tokens, bs) + 1);
  if (blocks > block_manager_.num_usable_blocks()) {
    throw std::invalid_argument(
        "the request needs up to " + std::to_string(blocks) + " KV blocks but the cache has " +
        std::to_string(block_manager_.num_usable_blocks()) + " (" +
        std::to_string(block_manager_.num_usable_blocks() * bs) + " tokens)");
  }
}

void ContinuousBatchingEngine::add_request(const std::string& request_id,
                                           const std::vector<int64_t>& prompt_token_ids,
                                           const SamplingParams& params,
                                           std::optional<double> arrival_time, int64_t priority) {
  validate(request_id, prompt_token_ids, params);
  auto request = std::make_unique<Request>();
  request->id = request_id;
  request->prompt = prompt_token_ids;
  request->params = params;
  request->metrics.arrival_time = arrival_time.value_or(now());
  const int64_t seq_id = next_seq_id_++;
  scheduler_.add(seq_id, std::vector<int32_t>(prompt_token_ids.begin(), prompt_token_ids.end()),
                 priority);
  request->completions.push_back({seq_id, CompletionOutput{}, 0, RequestRandom(params.seed)});
  request_of_seq_[seq_id] = request.get();
  requests_.emplace(request_id, std::move(request));
}

void ContinuousBatchingEngine::fork_samples(Request& request) {
  const int64_t parent = request.completions.front().seq_id;
  for (int64_t i = 1; i < request.params.n; ++i) {
    const int64_t child = next_seq_id_++;
    scheduler_.fork(parent, child);
    // Sample i draws from its own stream: seed + i when seeded, so the set is reproducible.
    std::optional<uint64_t> seed;
    if (request.params.seed) seed = *request.params.seed + static_cast<uint64_t>(i);
    CompletionOutput output;
    output.index = i;
    request.completions.push_back({child, output, 0, RequestRandom(seed)});
    request_of_seq_[child] = &request;
  }
}

void ContinuousBatchingEngine::check_stop(Request& request, Completion& completion,
                                          int64_t token) {
  const SamplingParams& p = request.params;
  CompletionOutput& out = completion.output;
  const int64_t generated = static_cast<int64_t>(out.token_ids.size());
  const bool may_stop = generated >= p.min_tokens;
  if (may_stop && ((!p.ignore_eos && contains(config_.eos_token_ids, token)) ||
                   contains(p.stop_token_ids, token))) {
    out.finish_reason = "stop";
  } else if (generated >= p.max_tokens ||
             static_cast<int64_t>(request.prompt.size()) + generated >= config_.max_model_len) {
    out.finish_reason = "length";
  }
  if (out.finished()) {
    scheduler_.finish(completion.seq_id);
    request_of_seq_.erase(completion.seq_id);
  } else {
    scheduler_.append_token(completion.seq_id, static_cast<int32_t>(token));
  }
}

std::vector<RequestOutput> ContinuousBatchingEngine::step() {
  std::vector<RequestOutput> outputs;
  for (auto& request : aborted_) outputs.push_back(make_output(*request));
  aborted_.clear();

  const SchedulerOutput work = scheduler_.schedule();
  if (work.empty()) return outputs;
  const double started = now();
  std::vector<std::pair<int32_t, int32_t>> copies;
  for (const BlockCopy& c : work.block_copies) copies.emplace_back(c.src, c.dst);
  kv_cache_.copy_blocks(copies);

  ForwardBatchBuilder builder(config_.block_size);
  std::vector<int64_t> sample_rows;  // rows of the batch whose logits are sampled
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    const auto& tokens = scheduler_.token_ids(s.seq_id);
    builder.add(std::vector<int64_t>(tokens.begin() + s.num_computed,
                                     tokens.begin() + s.num_computed + s.num_new_tokens),
                s.num_computed, block_manager_.block_table(s.seq_id));
    Request& request = *request_of_seq_.at(s.seq_id);
    if (request.metrics.first_scheduled_time == 0.0) {
      request.metrics.first_scheduled_time = started;
      request.num_cached_tokens = scheduler_.num_cached_tokens(s.seq_id);
    }
    if (s.samples) sample_rows.push_back(static_cast<int64_t>(i));
  }
  const ForwardBatch batch = builder.build(model_->device());
  at::Tensor hidden;
  try {
    hidden = model_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
  } catch (...) {
    // The step's K/V was not written: end its requests and drop any cache entry it created.
    std::vector<std::string> failed;
    for (const ScheduledSequence& s : work.scheduled) {
      const std::string& id = request_of_seq_.at(s.seq_id)->id;
      if (std::find(failed.begin(), failed.end(), id) == failed.end()) failed.push_back(id);
    }
    for (const std::string& id : failed) abort_request(id);
    block_manager_.reset_prefix_cache();
    throw;
  }
  scheduler_.update_computed(work);
  if (sample_rows.empty()) return outputs;

  // Sequences that sample, with n > 1 prompts forked into their n samples first: every sample
  // of a prompt draws from the same logits row.
  std::vector<int64_t> logit_rows;  // into the selected logits, one per sampled completion
  std::vector<std::pair<Request*, size_t>> targets;
  const at::Tensor last = batch.logits_indices.index_select(
      0, at::tensor(sample_rows, at::TensorOptions().dtype(at::kLong)).to(batch.logits_indices.device()));
  for (size_t r = 0; r < sample_rows.size(); ++r) {
    const int64_t seq_id = work.scheduled[sample_rows[r]].seq_id;
    Request& request = *request_of_seq_.at(seq_id);
    if (request.completions.size() < static_cast<size_t>(request.params.n)) {
      fork_samples(request);
      for (size_t c = 0; c < request.completions.size(); ++c) {
        logit_rows.push_back(static_cast<int64_t>(r));
        targets.emplace_back(&request, c);
      }
      continue;
    }
    for (size_t c = 0; c < request.completions.size(); ++c) {
      if (request.completions[c].seq_id == seq_id) {
        logit_rows.push_back(static_cast<int64_t>(r));
        targets.emplace_back(&request, c);
      }
    }
  }
  at::Tensor logits = model_->compute_logits(hidden.index_select(0, last));
  // Rows repeat only for prompts forked into n samples; otherwise the logits are used as they are
  // (a copy of [sequences, vocab] floats per step saved).
  bool identity = logit_rows.size() == sample_rows.size();
  for (size_t i = 0; identity && i < logit_rows.size(); ++i) {
    identity = logit_rows[i] == static_cast<int64_t>(i);
  }
  if (!identity) {
    logits = logits.index_select(
        0, at::tensor(logit_rows, at::TensorOptions().dtype(at::kLong)).to(logits.device()));
  }
  std::vector<SamplingRow> rows;
  for (const auto& [request, c] : targets) {
    Completion& completion = request->completions[c];
    rows.push_back({&request->params, &completion.random, &request->prompt,
                    &completion.output.token_ids, &config_.eos_token_ids});
  }
  SamplerOutput sampled = sampler_.sample(logits, rows);
  const int64_t* token = sampled.token_ids.data_ptr<int64_t>();
  const double t = now();

  std::vector<Request*> touched;
  for (size_t i = 0; i < targets.size(); ++i) {
    auto& [request, c] = targets[i];
    Completion& completion = request->completions[c];
    completion.output.token_ids.push_back(token[i]);
    if (sampled.logprobs[i]) completion.output.logprobs.push_back(std::move(*sampled.logprobs[i]));
    RequestMetrics& m = request->metrics;
    if (m.first_token_time == 0.0) m.first_token_time = t;
    m.last_token_time = t;
    ++m.num_generated_tokens;
    check_stop(*request, completion, token[i]);
    if (std::find(touched.begin(), touched.end(), request) == touched.end()) {
      touched.push_back(request);
    }
  }
  for (Request* request : touched) {
    RequestOutput out = make_output(*request);
    if (out.finished) {
      out.metrics.finished_time = t;
      retire(request->id, t);  // destroys *request
    }
    outputs.push_back(std::move(out));
  }
  return outputs;
}

void ContinuousBatchingEngine::retire(const std::string& request_id, double finished_time) {
  auto it = requests_.find(request_id);
  it->second->metrics.finished_time = finished_time;
  finished_metrics_[request_id] = it->second->metrics;
  requests_.erase(it);
}

void ContinuousBatchingEngine::finish_completion(const std::string& request_id, int64_t index,
                                                 const std::string& reason) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) throw std::out_of_range("unknown request id '" + request_id + "'");
  Request& request = *it->second;
  if (index < 0 || index >= static_cast<int64_t>(request.completions.size())) {
    throw std::out_of_range("request '" + request_id + "' has no running sample " +
                            std::to_string(index));
  }
  Completion& completion = request.completions[index];
  if (completion.output.finished()) return;
  completion.output.finish_reason = reason;
  completion.num_reported = completion.output.token_ids.size();
  scheduler_.finish(completion.seq_id);
  request_of_seq_.erase(completion.seq_id);
  bool all_finished = request.completions.size() == static_cast<size_t>(request.params.n);
  for (const Completion& c : request.completions) all_finished = all_finished && c.output.finished();
  if (all_finished) retire(request_id, now());
}

RequestOutput ContinuousBatchingEngine::make_output(Request& request) const {
  RequestOutput out;
  out.request_id = request.id;
  out.prompt_token_ids = request.prompt;
  out.finished = true;
  for (Completion& completion : request.completions) {
    CompletionOutput o = completion.output;
    o.new_token_ids.assign(o.token_ids.begin() + completion.num_reported, o.token_ids.end());
    completion.num_reported = o.token_ids.size();
    out.finished = out.finished && o.finished();
    out.outputs.push_back(std::move(o));
  }
  // Samples not forked yet (the prompt is still being computed) are unfinished too.
  out.finished = out.finished &&
                 request.completions.size() == static_cast<size_t>(request.params.n);
  out.num_cached_tokens = request.num_cached_tokens;
  out.metrics = request.metrics;
  return out;
}

bool ContinuousBatchingEngine::abort_request(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  Request& request = *it->second;
  const double t = now();
  for (Completion& completion : request.completions) {
    if (completion.output.finished()) continue;
    completion.output.finish_reason = "abort";
    scheduler_.finish(completion.seq_id);
    request_of_seq_.erase(completion.seq_id);
  }
  // Samples of n > 1 that were never forked are aborted too.
  for (int64_t i = static_cast<int64_t>(request.completions.size()); i < request.params.n; ++i) {
    CompletionOutput output;
    output.index = i;
    output.finish_reason = "abort";
    request.completions.push_back({-1, output, 0, RequestRandom(0)});
  }
  request.metrics.finished_time = t;
  finished_metrics_[request_id] = request.metrics;
  aborted_.push_back(std::move(it->second));
  requests_.erase(it);
  return true;
}

EngineStats ContinuousBatchingEngine::get_stats() const {
  EngineStats stats;
  std::unordered_set<const Request*> running;
  for (int64_t seq_id : scheduler_.running()) running.insert(request_of_seq_.at(seq_id));
  stats.num_running_requests = static_cast<int64_t>(running.size());
  stats.num_waiting_requests = static_cast<int64_t>(requests_.size()) - stats.num_running_requests;
  stats.num_running_sequences = scheduler_.num_running();
  stats.kv_cache_usage = block_manager_.usage();
  stats.prefix_cache_queries = block_manager_.prefix_cache_queries();
  stats.prefix_cache_hits = block_manager_.prefix_cache_hits();
  stats.num_preemptions = scheduler_.num_preemptions();
  stats.num_finished_requests = static_cast<int64_t>(finished_metrics_.size());
  stats.finished_metrics = finished_metrics_;
  return stats;
}

}  // namespace kvserve
