// ContinuousBatchingEngine, the KV-transfer side (prefill/decode disaggregation): a kHold
// request keeps its blocks after it finishes until release_kv; a kLoad request is admitted with
// blocks for its prompt, waits while a connector writes them (take_kv_loads), and decodes from
// the producer's first token once finish_kv_load says the KV is there.
#include <mutex>
#include <stdexcept>

#include "engine/engine_helpers.h"
#include "kvserve/continuous_batching_engine.h"

namespace kvserve {

using engine_helpers::now;

std::vector<KVLoad> ContinuousBatchingEngine::take_kv_loads() {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  std::vector<KVLoad> loads;
  loads.swap(pending_loads_);
  return loads;
}

void ContinuousBatchingEngine::finish_kv_load(int64_t load_id, int64_t first_token,
                                              std::optional<TokenLogprobs> logprobs) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    inbox_.push_back(Command{.kind = Command::Kind::kLoaded,
                             .load_id = load_id,
                             .token = first_token,
                             .logprobs = std::move(logprobs)});
  }
  try_apply_commands();
}

void ContinuousBatchingEngine::fail_kv_load(int64_t load_id, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    inbox_.push_back(
        Command{.kind = Command::Kind::kLoadFailed, .load_id = load_id, .error = error});
  }
  try_apply_commands();
}

std::optional<HeldKV> ContinuousBatchingEngine::held_kv(const std::string& request_id) const {
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  auto it = held_.find(request_id);
  if (it == held_.end()) return std::nullopt;
  return it->second.second;
}

bool ContinuousBatchingEngine::release_kv(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    if (!held_.count(request_id)) return false;
    inbox_.push_back(Command{.kind = Command::Kind::kRelease, .id = request_id});
  }
  try_apply_commands();
  return true;
}

void ContinuousBatchingEngine::queue_loads(const SchedulerOutput& work) {
  if (work.loads.empty()) return;
  const double t = now();
  std::vector<KVLoad> loads;
  for (int64_t seq_id : work.loads) {
    Request& request = *where_.at(seq_id).request;
    const SequenceState& s = sequences_.at(seq_id);
    request.metrics.first_scheduled_time = t;
    request.num_cached_tokens = s.num_cached_tokens;
    KVLoad load{.load_id = seq_id,
                .request_id = request.id,
                .num_prompt_tokens = s.num_prompt_tokens,
                .num_cached_tokens = s.num_cached_tokens};
    for (int64_t g = 0; g < block_manager_.num_groups(); ++g) {
      load.block_tables.push_back(block_manager_.block_table(seq_id, g));
    }
    load.state_slot = block_manager_.state_slot(seq_id);
    loads.push_back(std::move(load));
  }
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  for (KVLoad& load : loads) pending_loads_.push_back(std::move(load));
}

void ContinuousBatchingEngine::end_load(Command& command) {
  auto where = where_.find(command.load_id);
  Request* request = where == where_.end() ? nullptr : where->second.request;
  std::string error = command.error;
  bool ok = command.kind == Command::Kind::kLoaded && request != nullptr;
  const int64_t vocab = model_->config().vocab_size;
  if (ok && (command.token < 0 || command.token >= vocab)) {
    ok = false;
    error = "the KV producer's first token " + std::to_string(command.token) +
            " is outside the vocabulary [0, " + std::to_string(vocab) + ")";
  } else if (ok && request->params.logprobs && !command.logprobs) {
    ok = false;
    error = "the KV producer sent no logprobs for the first token";
  }
  bool runs = false;
  try {
    runs = scheduler_.end_load(command.load_id, ok);
  } catch (const std::out_of_range&) {
    return;  // not a load of this engine, or one that already ended
  }
  if (request == nullptr) return;  // its request ended while it loaded: the blocks are freed
  if (!runs) {
    end_request(request->id, "error", error);
    return;
  }
  Completion& completion = request->completions[where->second.completion];
  stats_.num_loaded_prompt_tokens +=
      static_cast<int64_t>(request->prompt.size()) - request->num_cached_tokens;
  // The producer drew this token's random number from the same seeded stream.
  if (!(request->params.temperature < SamplingParams::kGreedyTemperature)) {
    completion.random.next_uniform();
  }
  completion.output.token_ids.push_back(command.token);
  if (request->params.logprobs) completion.output.logprobs.push_back(*command.logprobs);
  RequestMetrics& m = request->metrics;
  m.first_token_time = m.last_token_time = now();
  stats_.time_to_first_token.observe(m.time_to_first_token());
  ++m.num_generated_tokens;
  ++stats_.num_generated_tokens;
  loaded_.push_back(request->id);
  append_token(*request, completion, command.token, /*kv_written=*/false);
}

void ContinuousBatchingEngine::report_loaded(std::vector<RequestOutput>& outputs) {
  const double t = now();
  for (const std::string& id : loaded_) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;  // aborted since: its abort output says so
    Request& request = *it->second;
    outputs.push_back(make_output(request));
    if (outputs.back().finished) {
      retire(request, t);
      outputs.back().metrics = request.metrics;
      requests_.erase(it);
    }
  }
  loaded_.clear();
}

bool ContinuousBatchingEngine::hold_blocks(Request& request, Completion& completion,
                                           const std::string& reason) {
  if (request.kv_transfer != KVTransfer::kHold || (reason != "stop" && reason != "length")) {
    return false;
  }
  const int64_t seq_id = completion.seq_id;
  HeldKV held{.num_tokens = sequences_.at(seq_id).num_computed_tokens,
              .state_slot = block_manager_.state_slot(seq_id)};
  for (int64_t g = 0; g < block_manager_.num_groups(); ++g) {
    held.block_tables.push_back(block_manager_.block_table(seq_id, g));
  }
  scheduler_.hold(seq_id);
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  auto old = held_.find(request.id);
  if (old != held_.end()) {  // a request of the same id held before: this one replaces it
    scheduler_.release(old->second.first);
    held_.erase(old);
  }
  held_.emplace(request.id, std::make_pair(seq_id, std::move(held)));
  return true;
}

}  // namespace kvserve
