// ContinuousBatchingEngine, the request side: validation, the thread-safe command queue (add and
// abort from any thread), outputs, finishing and retiring requests, and the stats snapshot. The
// step itself is in continuous_batching_engine.cpp.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "engine/engine_helpers.h"
#include "kvserve/continuous_batching_engine.h"

namespace kvserve {

using engine_helpers::ceil_div;
using engine_helpers::now;

// ------------------------------------------------------------------------------- requests in

void ContinuousBatchingEngine::validate(const std::string& request_id,
                                        const std::vector<int64_t>& prompt,
                                        const SamplingParams& params,
                                        std::optional<double> arrival_time) const {
  if (request_id.empty()) throw std::invalid_argument("the request id is empty");
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  const int64_t vocab = model_->config().vocab_size;
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab) {
      throw std::invalid_argument("token id " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  params.validate();
  const int64_t max_logprobs = std::min(config_.max_logprobs, vocab);
  if (params.logprobs && *params.logprobs > max_logprobs) {
    throw std::invalid_argument("logprobs must be at most " + std::to_string(max_logprobs) +
                                " (max_logprobs, and the vocabulary size), got " +
                                std::to_string(*params.logprobs));
  }
  if (arrival_time && !(std::isfinite(*arrival_time) && *arrival_time <= now())) {
    throw std::invalid_argument("arrival_time must be a finite time.monotonic() value that is not "
                                "in the future");
  }
  // Compared by subtraction: prompt + max_tokens could overflow int64.
  const int64_t len = static_cast<int64_t>(prompt.size());
  const int64_t room = config_.max_model_len - len;
  if (params.max_tokens > room) {
    throw std::invalid_argument("the prompt (" + std::to_string(len) + " tokens) + max_tokens (" +
                                std::to_string(params.max_tokens) + ") exceeds max_model_len " +
                                std::to_string(config_.max_model_len));
  }
  // All n samples at full length: shared prompt blocks plus each other sample's own blocks (one
  // more for its copy of the last, partly filled prompt block).
  const int64_t bs = config_.block_size;
  const int64_t usable = block_manager_.num_usable_blocks();
  const int64_t chunk = config_.max_num_batched_tokens;
  const int64_t first = block_manager_.max_blocks_held(len, len + params.max_tokens, chunk);
  const int64_t per_sample =
      block_manager_.max_blocks_held(params.max_tokens + bs, params.max_tokens + bs, 1);
  if (first > usable || params.n - 1 > (usable - first) / per_sample) {
    throw std::invalid_argument(
        "the request needs up to " + std::to_string(first) + " + " +
        std::to_string(params.n - 1) + " x " + std::to_string(per_sample) +
        " KV blocks but the cache has " + std::to_string(usable) + " (" +
        std::to_string(usable * bs) + " tokens)");
  }
}

void ContinuousBatchingEngine::add_request(const std::string& request_id,
                                           const std::vector<int64_t>& prompt_token_ids,
                                           const SamplingParams& params,
                                           std::optional<double> arrival_time, int64_t priority,
                                           int32_t lora_slot, uint64_t lora_key) {
  validate(request_id, prompt_token_ids, params, arrival_time);
  if (lora_slot < -1 || lora_slot >= model_->num_lora_slots()) {
    throw std::invalid_argument("lora_slot " + std::to_string(lora_slot) + " is outside [-1, " +
                                std::to_string(model_->num_lora_slots()) + ")");
  }
  auto request = std::make_unique<Request>();
  request->lora_slot = lora_slot;
  request->lora_key = lora_key;
  request->id = request_id;
  request->prompt = prompt_token_ids;
  request->params = params;
  request->priority = priority;
  request->metrics.arrival_time = arrival_time.value_or(now());
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (!live_ids_.insert(request_id).second) {
      throw std::invalid_argument("request id '" + request_id + "' is already in use");
    }
    inbox_.push_back(Command{std::move(request), {}});
  }
  try_apply_commands();
}

void ContinuousBatchingEngine::set_lora(int64_t slot, const LoraFactors& factors) {
  if (slot < 0 || slot >= model_->num_lora_slots()) {
    throw std::invalid_argument("LoRA slot " + std::to_string(slot) + " is outside [0, " +
                                std::to_string(model_->num_lora_slots()) + ")");
  }
  std::lock_guard<std::mutex> owner(step_mutex_);
  if (factors.empty()) {
    model_->clear_lora(slot);
  } else {
    model_->set_lora(slot, factors);
  }
}

bool ContinuousBatchingEngine::abort_request(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (!live_ids_.count(request_id)) return false;
    inbox_.push_back(Command{nullptr, request_id});
  }
  try_apply_commands();
  return true;
}

void ContinuousBatchingEngine::try_apply_commands() {
  std::unique_lock<std::mutex> owner(step_mutex_, std::try_to_lock);
  if (!owner.owns_lock()) return;  // the running step applies them when it starts the next
  apply_commands();
  publish_stats();
}

void ContinuousBatchingEngine::apply_commands() {
  std::deque<Command> commands;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    commands.swap(inbox_);
  }
  for (Command& c : commands) {
    if (c.request) {
      admit(std::move(c.request));
    } else {
      abort_now(c.abort_id);
    }
  }
}

void ContinuousBatchingEngine::admit(std::unique_ptr<Request> request) {
  const int64_t seq_id = next_seq_id_++;
  scheduler_.add(seq_id, std::vector<int32_t>(request->prompt.begin(), request->prompt.end()),
                 request->priority, request->params.max_tokens, request->lora_slot,
                 request->lora_key);
  request->completions.push_back(
      {seq_id, CompletionOutput{}, 0, RequestRandom(request->params.seed), true});
  where_[seq_id] = {request.get(), 0};
  const std::string id = request->id;
  requests_.emplace(id, std::move(request));
}

void ContinuousBatchingEngine::abort_now(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;  // it finished before the abort was applied
  Request& request = *it->second;
  for (Completion& completion : request.completions) {
    if (!completion.output.finished()) end_completion(completion, "abort");
  }
  // Samples of n > 1 that were never forked are aborted too.
  for (int64_t i = static_cast<int64_t>(request.completions.size()); i < request.params.n; ++i) {
    CompletionOutput output;
    output.index = i;
    output.finish_reason = "abort";
    request.completions.push_back({-1, output, 0, RequestRandom(0), true});
  }
  ++stats_.num_aborted_requests;
  std::unique_ptr<Request> owned = std::move(it->second);
  requests_.erase(it);
  retire(*owned, now());
  aborted_.push_back(std::move(owned));
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  ++num_unreported_;
}

RequestOutput ContinuousBatchingEngine::make_output(Request& request) const {
  RequestOutput out;
  out.request_id = request.id;
  out.prompt_token_ids = request.prompt;
  for (Completion& completion : request.completions) {
    const CompletionOutput& state = completion.output;
    CompletionOutput o;
    o.index = state.index;
    o.token_ids = state.token_ids;
    o.finish_reason = state.finish_reason;
    const size_t from = completion.num_reported;
    o.new_token_ids.assign(state.token_ids.begin() + from, state.token_ids.end());
    if (from < state.logprobs.size()) {
      o.new_logprobs.assign(state.logprobs.begin() + from, state.logprobs.end());
    }
    if (state.finished()) o.logprobs = state.logprobs;  // the whole list once, at the end
    completion.num_reported = state.token_ids.size();
    out.outputs.push_back(std::move(o));
  }
  out.finished = all_finished(request);
  out.num_cached_tokens = request.num_cached_tokens;
  out.metrics = request.metrics;
  out.error = request.error;
  return out;
}

RequestMetrics ContinuousBatchingEngine::finish_completion(const std::string& request_id,
                                                           int64_t index,
                                                           const std::string& reason) {
  std::lock_guard<std::mutex> owner(step_mutex_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) throw std::out_of_range("unknown request id '" + request_id + "'");
  Request& request = *it->second;
  if (index < 0 || index >= static_cast<int64_t>(request.completions.size())) {
    throw std::out_of_range("request '" + request_id + "' has no running sample " +
                            std::to_string(index));
  }
  Completion& completion = request.completions[index];
  if (completion.output.finished()) return request.metrics;
  end_completion(completion, reason);
  completion.num_reported = completion.output.token_ids.size();
  const RequestMetrics metrics = request.metrics;
  if (!all_finished(request)) return metrics;
  retire(request, now());
  const RequestMetrics final_metrics = request.metrics;
  requests_.erase(it);
  publish_stats();
  return final_metrics;
}

void ContinuousBatchingEngine::retire(Request& request, double finished_time) {
  RequestMetrics& m = request.metrics;
  m.finished_time = finished_time;
  ++stats_.num_finished_requests;
  if (!request.error.empty()) ++stats_.num_failed_requests;
  stats_.e2e_latency.observe(m.e2e_latency());
  if (m.num_generated_tokens > 1) stats_.time_per_output_token.observe(m.time_per_output_token());
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  live_ids_.erase(request.id);
}

// ------------------------------------------------------------------------------------ stats

bool ContinuousBatchingEngine::has_unfinished_requests() const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  return !live_ids_.empty() || num_unreported_ > 0;
}

void ContinuousBatchingEngine::publish_stats() {
  // One pass over the running sequences, which the step has just walked anyway.
  const uint64_t mark = ++next_mark_;
  int64_t running = 0;
  for (int64_t seq_id : scheduler_.running()) {
    Request& request = *where_.at(seq_id).request;
    if (request.mark != mark) {
      request.mark = mark;
      ++running;
    }
  }
  stats_.num_running_requests = running;
  stats_.num_running_sequences = scheduler_.num_running();
  stats_.kv_cache_usage = block_manager_.usage();
  stats_.prefix_cache_queries = block_manager_.prefix_cache_queries();
  stats_.prefix_cache_hits = block_manager_.prefix_cache_hits();
  stats_.num_preemptions = scheduler_.num_preemptions();
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  stats_.num_waiting_requests = static_cast<int64_t>(live_ids_.size()) - running;
  published_stats_ = stats_;
}

EngineStats ContinuousBatchingEngine::get_stats() const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  return published_stats_;
}

}  // namespace kvserve
