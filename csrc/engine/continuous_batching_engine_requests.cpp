// ContinuousBatchingEngine, the request side: validation, the thread-safe command queue (add and
// abort from any thread), outputs, finishing and retiring requests, and the stats snapshot. The
// step itself is in continuous_batching_engine.cpp.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "engine/engine_helpers.h"
#include "kvserve/continuous_batching_engine.h"
#include "kvserve/tensor_parallel_worker.h"

namespace kvserve {

using engine_helpers::ceil_div;
using engine_helpers::now;

namespace {

int64_t num_code_points(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;  // continuation bytes start 10xxxxxx
  return n;
}

/// The engine's bounds on a request's stop conditions: its stop strings are matched against
/// every sample's new text at every step, so their number and length bound that step's work.
void check_stop_limits(const SamplingParams& params, const EngineConfig& config) {
  const int64_t max_count = config.max_stop_strings;
  if (max_count > 0 && static_cast<int64_t>(params.stop.size()) > max_count) {
    throw std::invalid_argument("at most " + std::to_string(max_count) +
                                " stop strings are allowed (max_stop_strings), got " +
                                std::to_string(params.stop.size()));
  }
  const int64_t max_length = config.max_stop_string_length;
  if (max_length <= 0) return;
  for (const std::string& stop : params.stop) {
    // A byte count bounds the code points from above: only long strings are counted.
    if (static_cast<int64_t>(stop.size()) > max_length && num_code_points(stop) > max_length) {
      throw std::invalid_argument("a stop string may have at most " + std::to_string(max_length) +
                                  " characters (max_stop_string_length), got one of " +
                                  std::to_string(num_code_points(stop)));
    }
  }
}

}  // namespace

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
  check_stop_limits(params, config_);
  // Each stop token id is compared with every sampled token: at most one per vocabulary entry,
  // so that costs no more than the sampling itself.
  if (static_cast<int64_t>(params.stop_token_ids.size()) > vocab) {
    throw std::invalid_argument("at most " + std::to_string(vocab) +
                                " stop token ids (the vocabulary size), got " +
                                std::to_string(params.stop_token_ids.size()));
  }
  for (int64_t id : params.stop_token_ids) {
    if (id >= vocab) {
      throw std::invalid_argument("stop token id " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  if (params.allowed_token_ids) {
    const auto& allowed = *params.allowed_token_ids;
    if (static_cast<int64_t>(allowed.size()) > vocab) {
      throw std::invalid_argument("at most " + std::to_string(vocab) +
                                  " allowed token ids (the vocabulary size), got " +
                                  std::to_string(allowed.size()));
    }
    for (int64_t id : allowed) {
      if (id >= vocab) {
        throw std::invalid_argument("allowed token id " + std::to_string(id) +
                                    " is outside the vocabulary [0, " + std::to_string(vocab) +
                                    ")");
      }
    }
  }
  if (!params.bad_words.empty() && params.bad_words_token_ids.empty()) {
    throw std::invalid_argument(
        "bad_words are banned by their tokens: LLMEngine.add_request tokenizes them (a C++ "
        "caller sets bad_words_token_ids)");
  }
  for (const std::vector<int64_t>& word : params.bad_words_token_ids) {
    for (int64_t id : word) {
      if (id >= vocab) {
        throw std::invalid_argument("bad word token id " + std::to_string(id) +
                                    " is outside the vocabulary [0, " + std::to_string(vocab) +
                                    ")");
      }
    }
  }
  // At most one entry per vocabulary entry (a map), so no larger than the logits it changes.
  if (!params.logit_bias.empty() && params.logit_bias.rbegin()->first >= vocab) {
    throw std::invalid_argument("logit_bias token id " +
                                std::to_string(params.logit_bias.rbegin()->first) +
                                " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  const int64_t max_logprobs = std::min(config_.max_logprobs, vocab);
  for (const auto& [name, asked] : {std::pair{"logprobs", params.logprobs},
                                     std::pair{"prompt_logprobs", params.prompt_logprobs}}) {
    if (asked && *asked > max_logprobs) {
      throw std::invalid_argument(std::string(name) + " must be at most " +
                                  std::to_string(max_logprobs) +
                                  " (max_logprobs, and the vocabulary size), got " +
                                  std::to_string(*asked));
    }
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
                                           int32_t lora_slot, uint64_t lora_key,
                                           KVTransfer kv_transfer) {
  validate(request_id, prompt_token_ids, params, arrival_time);
  if (kv_transfer != KVTransfer::kNone && params.n != 1) {
    throw std::invalid_argument("a request whose KV is transferred takes n = 1, got n = " +
                                std::to_string(params.n));
  }
  if (kv_transfer == KVTransfer::kLoad && params.prompt_logprobs) {
    throw std::invalid_argument("prompt_logprobs need the prompt computed here, not loaded");
  }
  if (kv_transfer == KVTransfer::kLoad && config_.speculative.method == "draft_model") {
    throw std::invalid_argument("a loaded prompt brings no draft-model KV: KV loading and "
                                "draft-model speculation do not combine (n-gram does)");
  }
  if (kv_transfer == KVTransfer::kLoad && config_.speculative.method == "mtp") {
    throw std::invalid_argument("a loaded prompt brings no hidden states for the MTP modules: "
                                "KV loading and MTP speculation do not combine (n-gram does)");
  }
  const bool pending = lora_slot == Scheduler::kLoraPending && model_->num_lora_slots() > 0;
  if (!pending && (lora_slot < -1 || lora_slot >= model_->num_lora_slots())) {
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
  request->kv_transfer = kv_transfer;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (live_ids_.count(request_id)) {
      throw std::invalid_argument("request id '" + request_id + "' is already in use");
    }
    // Waiting: unfinished, not running, and not an abort whose output is still to come.
    const int64_t waiting = static_cast<int64_t>(live_ids_.size() - unreported_ids_.size()) -
                            published_stats_.num_running_requests;
    if (config_.max_waiting_requests > 0 && waiting >= config_.max_waiting_requests) {
      throw EngineOverloaded("the engine is at capacity: " + std::to_string(waiting) +
                             " requests wait to run (max_waiting_requests); retry later");
    }
    live_ids_.insert(request_id);
    inbox_.push_back(Command{.kind = Command::Kind::kAdd, .request = std::move(request)});
  }
  try_apply_commands();
}

void ContinuousBatchingEngine::set_lora(int64_t slot, const LoraFactors& factors,
                                        const std::vector<LoraFactors>& worker_factors) {
  if (slot < 0 || slot >= model_->num_lora_slots()) {
    throw std::invalid_argument("LoRA slot " + std::to_string(slot) + " is outside [0, " +
                                std::to_string(model_->num_lora_slots()) + ")");
  }
  const size_t workers = workers_ ? static_cast<size_t>(workers_->size() - 1) : 0;
  if (worker_factors.size() != workers) {
    throw std::invalid_argument("set_lora: factors for " + std::to_string(worker_factors.size()) +
                                " workers, and the model has " + std::to_string(workers));
  }
  std::lock_guard<std::mutex> owner(step_mutex_);
  if (factors.empty()) {
    model_->clear_lora(slot);
  } else {
    model_->set_lora(slot, factors);
  }
  // After rank 0's own, which checks them against the same targets; before any later step.
  if (workers_) {
    send_to_workers(*workers_, WorkerCommand::kSetLora, pack_lora(slot, worker_factors));
  }
}

bool ContinuousBatchingEngine::assign_lora(const std::string& request_id, int32_t lora_slot,
                                           uint64_t lora_key) {
  if (lora_slot < 0 || lora_slot >= model_->num_lora_slots()) {
    throw std::invalid_argument("assign_lora: slot " + std::to_string(lora_slot) +
                                " is outside [0, " + std::to_string(model_->num_lora_slots()) +
                                ")");
  }
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (!live_ids_.count(request_id) || unreported_ids_.count(request_id)) return false;
    inbox_.push_back(Command{.kind = Command::Kind::kAssignLora,
                             .id = request_id,
                             .lora_slot = lora_slot,
                             .lora_key = lora_key});
  }
  try_apply_commands();
  return true;
}

bool ContinuousBatchingEngine::abort_request(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (!live_ids_.count(request_id) || unreported_ids_.count(request_id)) return false;
    inbox_.push_back(Command{.kind = Command::Kind::kAbort, .id = request_id});
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
    switch (c.kind) {
      case Command::Kind::kAdd:
        admit(std::move(c.request));
        break;
      case Command::Kind::kAbort:
        abort_now(c.id);
        break;
      case Command::Kind::kLoaded:
      case Command::Kind::kLoadFailed:
        end_load(c);
        break;
      case Command::Kind::kAssignLora:
        assign_lora_now(c);
        break;
      case Command::Kind::kRelease: {
        std::lock_guard<std::mutex> lock(inbox_mutex_);
        auto it = held_.find(c.id);
        if (it == held_.end()) break;
        scheduler_.release(it->second.first);
        held_.erase(it);
        break;
      }
    }
  }
}

uint64_t ContinuousBatchingEngine::cache_key(const Request& request, int64_t seq_id) {
  // A request that scores its prompt must compute all of it (as in vLLM): a salt of its own
  // keeps its blocks' hashes apart from every other sequence's, so no cached prefix is read.
  return request.params.prompt_logprobs
             ? PagedBlockManager::default_block_hash(request.lora_key, nullptr, 0,
                                                     static_cast<uint64_t>(seq_id) + 1)
             : request.lora_key;
}

void ContinuousBatchingEngine::admit(std::unique_ptr<Request> request) {
  const int64_t seq_id = next_seq_id_++;
  scheduler_.add(seq_id, std::vector<int32_t>(request->prompt.begin(), request->prompt.end()),
                 request->priority, request->params.max_tokens, request->lora_slot,
                 cache_key(*request, seq_id), request->kv_transfer == KVTransfer::kLoad,
                 request->params.n);
  request->completions.push_back(
      {seq_id, CompletionOutput{}, 0, RequestRandom(request->params.seed), true});
  where_[seq_id] = {request.get(), 0};
  const std::string id = request->id;
  requests_.emplace(id, std::move(request));
}

void ContinuousBatchingEngine::assign_lora_now(const Command& c) {
  auto it = requests_.find(c.id);
  if (it == requests_.end()) return;  // it finished (an abort) before its adapter loaded
  Request& request = *it->second;
  if (request.lora_slot != Scheduler::kLoraPending || request.completions.empty()) return;
  request.lora_slot = c.lora_slot;
  request.lora_key = c.lora_key;
  const int64_t seq_id = request.completions.front().seq_id;
  scheduler_.set_lora(seq_id, c.lora_slot, cache_key(request, seq_id));
}

void ContinuousBatchingEngine::abort_now(const std::string& request_id) {
  end_request(request_id, "abort", "");
}

void ContinuousBatchingEngine::end_request(const std::string& request_id,
                                           const std::string& reason, const std::string& error) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;  // it finished before the abort was applied
  Request& request = *it->second;
  if (!error.empty()) request.error = error;
  for (Completion& completion : request.completions) {
    if (!completion.output.finished()) end_completion(completion, reason);
  }
  // Samples of n > 1 that were never forked end too.
  for (int64_t i = static_cast<int64_t>(request.completions.size()); i < request.params.n; ++i) {
    CompletionOutput output;
    output.index = i;
    output.finish_reason = reason;
    request.completions.push_back({-1, output, 0, RequestRandom(0), true});
  }
  if (reason == "abort") ++stats_.num_aborted_requests;
  std::unique_ptr<Request> owned = std::move(it->second);
  requests_.erase(it);
  // The id stays in use until the output is reported: a caller that finished the request itself
  // in the meantime (finish_completion) must not see a new request of the same id take it.
  retire(*owned, now(), /*release_id=*/false);
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    unreported_ids_.insert(owned->id);
  }
  aborted_.push_back(std::move(owned));
}

RequestOutput ContinuousBatchingEngine::make_output(Request& request) const {
  RequestOutput out;
  out.request_id = request.id;
  out.prompt_token_ids = request.prompt;
  for (Completion& completion : request.completions) {
    const CompletionOutput& state = completion.output;
    CompletionOutput o;
    o.index = state.index;
    o.finish_reason = state.finish_reason;
    const size_t from = completion.num_reported;
    o.new_token_ids.assign(state.token_ids.begin() + from, state.token_ids.end());
    if (from < state.logprobs.size()) {
      o.new_logprobs.assign(state.logprobs.begin() + from, state.logprobs.end());
    }
    if (state.finished()) {  // the whole lists once, at the end
      o.token_ids = state.token_ids;
      o.logprobs = state.logprobs;
    }
    completion.num_reported = state.token_ids.size();
    out.outputs.push_back(std::move(o));
  }
  out.finished = all_finished(request);
  out.num_cached_tokens = request.num_cached_tokens;
  if (request.params.prompt_logprobs) {
    const bool scored = request.prompt_logprobs.size() + 1 == request.prompt.size();
    if ((scored && !request.prompt_logprobs_reported) || out.finished) {
      out.prompt_logprobs = request.prompt_logprobs;
      request.prompt_logprobs_reported = scored;
    }
  }
  out.metrics = request.metrics;
  out.error = request.error;
  return out;
}

RequestMetrics ContinuousBatchingEngine::finish_completion(const std::string& request_id,
                                                           int64_t index,
                                                           const std::string& reason) {
  std::lock_guard<std::mutex> owner(step_mutex_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    for (const auto& aborted : aborted_) {
      if (aborted->id == request_id) return aborted->metrics;
    }
    throw std::out_of_range("unknown request id '" + request_id + "'");
  }
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

void ContinuousBatchingEngine::retire(Request& request, double finished_time, bool release_id) {
  RequestMetrics& m = request.metrics;
  m.finished_time = finished_time;
  ++stats_.num_finished_requests;
  if (!request.error.empty()) ++stats_.num_failed_requests;
  stats_.e2e_latency.observe(m.e2e_latency());
  if (m.num_generated_tokens > 1) stats_.time_per_output_token.observe(m.time_per_output_token());
  if (!release_id) return;
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  live_ids_.erase(request.id);
}

void ContinuousBatchingEngine::inject_step_failures(int64_t count) {
  if (count < 0) throw std::invalid_argument("count must be >= 0, got " + std::to_string(count));
  num_injected_failures_ = count;
}

// ------------------------------------------------------------------------------------ stats

bool ContinuousBatchingEngine::has_unfinished_requests() const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  return !live_ids_.empty();
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
  stats_.num_loading_requests = scheduler_.num_loading();
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  stats_.num_held_requests = static_cast<int64_t>(held_.size());
  stats_.num_waiting_requests =
      static_cast<int64_t>(live_ids_.size() - unreported_ids_.size()) - running;
  published_stats_ = stats_;
}

EngineStats ContinuousBatchingEngine::get_stats() const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  return published_stats_;
}

}  // namespace kvserve
