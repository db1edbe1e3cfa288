// ContinuousBatchingEngine, the step: schedule -> ModelRunner::execute -> update_from_output, and
// what ends requests inside it. The request side is in continuous_batching_engine_requests.cpp.
#include "kvserve/continuous_batching_engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/engine_helpers.h"

namespace kvserve {
namespace {

using engine_helpers::contains;
using engine_helpers::message_of;
using engine_helpers::now;

const char* kNoDistribution =
    "the model's logits held no token with a non-zero probability (NaN or inf in the logits, or "
    "every token masked by allowed_token_ids, min_tokens, stop_token_ids and the filters)";
const char* kNeverScheduled =
    "the request could not be scheduled: nothing ran for two steps while it waited";

}  // namespace

ContinuousBatchingEngine::ContinuousBatchingEngine(std::shared_ptr<CausalLM> model,
                                                   EngineConfig config,
                                                   std::shared_ptr<CausalLM> draft_model,
                                                   std::shared_ptr<Communicator> workers)
    : model_(std::move(model)),
      config_(resolve_engine_config(std::move(config), model_->config(), model_->dtype(),
                                    draft_model ? &draft_model->config() : nullptr)),
      // A draft model keeps its own pool on the same block tables: it needs every layer's blocks
      // (no sliding-window groups) until the draft's pool is grouped too.
      block_manager_({.num_blocks = config_.num_blocks,
                      .block_size = config_.block_size,
                      .enable_prefix_caching = config_.enable_prefix_caching,
                      .group_windows =
                          KVCacheLayout::for_model(model_->config(), draft_model == nullptr)
                              .group_windows(),
                      .num_state_slots = model_->config().num_ssm_layers() > 0
                                             ? config_.max_num_seqs
                                             : 0,
                      .num_state_snapshots = config_.num_state_snapshots,
                      .state_backups = config_.speculative.enabled()}),
      scheduler_(SchedulerConfig{config_.max_num_seqs, config_.max_num_batched_tokens,
                                 config_.max_model_len},
                 block_manager_, sequences_),
      speculator_(SpeculativeDecoder::create(config_.speculative, *model_, std::move(draft_model),
                                             config_.num_blocks, config_.block_size,
                                             config_.max_model_len, workers)),
      workers_(workers),
      runner_(model_, sequences_,
              {.num_blocks = config_.num_blocks,
               .block_size = config_.block_size,
               .group_windows = block_manager_.group_windows(),
               .speculator = speculator_.get(),
               .kv_cache_dtype = config_.kv_cache_dtype,
               .num_state_slots = block_manager_.num_state_pool_slots(),
               .ssm_state_dtype = config_.ssm_state_dtype,
               .cuda_graph_max_batch = config_.cuda_graph_max_batch,
               .max_model_len = config_.max_model_len,
               .workers = std::move(workers)}) {
  if (speculator_) {
    stats_.accepted_per_position.assign(config_.speculative.num_speculative_tokens, 0);
  }
  publish_stats();
}

// ------------------------------------------------------------------------------------ the step

std::vector<RequestOutput> ContinuousBatchingEngine::step(bool finished_only) {
  std::lock_guard<std::mutex> owner(step_mutex_);
  apply_commands();
  std::vector<RequestOutput> outputs = take_aborted_outputs();
  report_loaded(outputs);
  const int64_t num_speculative =
      speculator_ ? speculator_->num_speculative_tokens(scheduler_.num_running()) : 0;
  SchedulerOutput work = scheduler_.schedule(num_speculative);
  queue_loads(work);
  if (work.empty()) {
    // Loads in flight are progress: their requests run once their KV arrives; so is a
    // launched step's samples.
    if (in_flight_) {
      finish_in_flight(outputs, finished_only);
      num_idle_steps_ = 0;
    } else if (scheduler_.num_loading() == 0) {
      fail_if_stalled(outputs);
    } else {
      num_idle_steps_ = 0;
    }
  } else {
    num_idle_steps_ = 0;
    StepSamples samples = plan_samples(work);
    if (config_.async_scheduling) {
      launch_step(std::move(work), std::move(samples), outputs, finished_only);
    } else {
      const ModelRunnerOutput result = execute(work, samples);
      update_from_output(work, samples, result, outputs, finished_only);
    }
    block_manager_.commit_state_snapshots();  // states saved this step now serve prefix hits
  }
  publish_stats();
  return outputs;
}

std::vector<RequestOutput> ContinuousBatchingEngine::take_aborted_outputs() {
  std::vector<RequestOutput> outputs;
  for (auto& request : aborted_) outputs.push_back(make_output(*request));
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    for (auto& request : aborted_) {
      unreported_ids_.erase(request->id);
      live_ids_.erase(request->id);
    }
  }
  aborted_.clear();
  return outputs;
}

ContinuousBatchingEngine::StepSamples ContinuousBatchingEngine::plan_samples(
    const SchedulerOutput& work) {
  const double started = now();
  StepSamples samples;
  const uint64_t forking = ++next_mark_;
  // First every new fork, so that the completions vectors no longer move when rows point in.
  for (const ScheduledSequence& s : work.scheduled) {
    Request& request = *where_.at(s.seq_id).request;
    if (request.metrics.first_scheduled_time == 0.0) {
      request.metrics.first_scheduled_time = started;
      request.num_cached_tokens = sequences_.at(s.seq_id).num_cached_tokens;
    }
    if (!s.samples || request.completions.size() == static_cast<size_t>(request.params.n)) {
      continue;
    }
    // The prompt's first sample: its n samples draw from these logits; sample i from its own
    // stream (seed + i when seeded, so the set is reproducible).
    request.completions.reserve(request.params.n);
    for (int64_t i = 1; i < request.params.n; ++i) {
      std::optional<uint64_t> seed;
      if (request.params.seed) seed = *request.params.seed + static_cast<uint64_t>(i);
      CompletionOutput output;
      output.index = i;
      request.completions.push_back({next_seq_id_++, output, 0, RequestRandom(seed), false});
    }
    samples.forking.push_back(&request);
    request.mark = forking;
  }
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    if (!s.samples) continue;
    const Where where = where_.at(s.seq_id);
    Request& request = *where.request;
    const bool first = request.mark == forking;
    const size_t begin = first ? 0 : where.completion;
    const size_t end = first ? request.completions.size() : where.completion + 1;
    for (size_t c = begin; c < end; ++c) {
      Completion& completion = request.completions[c];
      samples.targets.push_back(
          {static_cast<int64_t>(i), s.num_new_tokens - 1,
           SamplingRow{&request.params, &completion.random, &request.prompt,
                       &completion.output.token_ids, &config_.eos_token_ids}});
      samples.completions.push_back({&request, &completion});
      samples.seq_ids.push_back(completion.seq_id);
    }
  }
  plan_prompt_logprobs(work, samples);
  return samples;
}

void ContinuousBatchingEngine::plan_prompt_logprobs(const SchedulerOutput& work,
                                                    StepSamples& samples) {
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    Request& request = *where_.at(s.seq_id).request;
    if (!request.params.prompt_logprobs) continue;
    // The logits at position p score prompt token p + 1; tokens 1..recorded have their entries
    // (a sequence recomputed after a preemption scores nothing twice).
    const int64_t last = static_cast<int64_t>(request.prompt.size()) - 1;
    const int64_t recorded = static_cast<int64_t>(request.prompt_logprobs.size());
    const int64_t begin = std::max(s.num_computed, recorded);
    const int64_t end = std::min(s.num_computed + s.num_new_tokens, last);
    if (begin >= end) continue;
    samples.prompt_targets.push_back(
        {static_cast<int64_t>(i), begin - s.num_computed,
         std::vector<int64_t>(request.prompt.begin() + begin + 1, request.prompt.begin() + end + 1),
         *request.params.prompt_logprobs});
    samples.prompt_requests.push_back(&request);
  }
}

ModelRunnerOutput ContinuousBatchingEngine::execute(const SchedulerOutput& work,
                                                    const StepSamples& samples) {
  try {
    if (num_injected_failures_.load() > 0) {
      --num_injected_failures_;
      throw std::runtime_error("an injected step failure (inject_step_failures)");
    }
    return runner_.execute(work, samples.targets, samples.prompt_targets);
  } catch (...) {
    fail_step(&work, message_of(std::current_exception()));
    throw;
  }
}

void ContinuousBatchingEngine::fail_step(const SchedulerOutput* work, const std::string& error) {
  // The step's K/V may be partial: end its requests with an error (their clients must not take a
  // truncated output for a finished one) and drop any cache entry the step created. A step in
  // flight is lost with it: its samples may never arrive.
  std::vector<std::string> failed;
  auto add = [&](const SchedulerOutput& w) {
    for (const ScheduledSequence& s : w.scheduled) {
      auto where = where_.find(s.seq_id);
      if (where == where_.end()) continue;
      const std::string& id = where->second.request->id;
      if (std::find(failed.begin(), failed.end(), id) == failed.end()) failed.push_back(id);
    }
  };
  if (work) add(*work);
  if (in_flight_) add(in_flight_->work);
  in_flight_.reset();
  const std::string message = "the engine step running this request failed: " + error;
  for (const std::string& id : failed) end_request(id, "error", message);
  block_manager_.reset_prefix_cache();
  block_manager_.discard_state_snapshots();  // states the step did not finish writing
  publish_stats();
}

void ContinuousBatchingEngine::update_from_output(const SchedulerOutput& work,
                                                  const StepSamples& samples,
                                                  const ModelRunnerOutput& result,
                                                  std::vector<RequestOutput>& outputs,
                                                  bool finished_only) {
  advance(work, result.cuda_graph);
  fork_samples(samples);
  for (size_t k = 0; k < samples.prompt_requests.size(); ++k) {
    std::vector<TokenLogprobs>& scored = samples.prompt_requests[k]->prompt_logprobs;
    scored.insert(scored.end(), result.prompt_logprobs[k].begin(), result.prompt_logprobs[k].end());
  }
  take_samples(work, samples, result, outputs, finished_only, /*pending=*/false);
}

void ContinuousBatchingEngine::advance(const SchedulerOutput& work, bool cuda_graph) {
  for (const ScheduledSequence& s : work.scheduled) {
    const int64_t prompt = sequences_.at(s.seq_id).num_prompt_tokens;
    stats_.num_computed_prompt_tokens +=
        std::max<int64_t>(0, std::min(s.num_computed + s.num_new_tokens, prompt) - s.num_computed);
  }
  scheduler_.update_computed(work);
  ++stats_.num_steps;
  if (cuda_graph) ++stats_.num_cuda_graph_steps;
}

void ContinuousBatchingEngine::fork_samples(const StepSamples& samples) {
  for (Request* request : samples.forking) {
    const int64_t parent = request->completions.front().seq_id;
    for (size_t c = 1; c < request->completions.size(); ++c) {
      Completion& child = request->completions[c];
      scheduler_.fork(parent, child.seq_id);
      where_[child.seq_id] = {request, c};
      child.forked = true;
    }
  }
}

void ContinuousBatchingEngine::take_samples(const SchedulerOutput& work,
                                            const StepSamples& samples,
                                            const ModelRunnerOutput& result,
                                            std::vector<RequestOutput>& outputs,
                                            bool finished_only, bool pending) {
  const double t = now();
  const uint64_t mark = ++next_mark_;
  std::vector<Request*> touched;
  for (size_t i = 0; i < samples.targets.size(); ++i) {
    // Ended since the launch (a stop, an abort): its request may be gone.
    if (pending && where_.count(samples.seq_ids[i]) == 0) continue;
    auto [request_ptr, completion_ptr] = samples.completions[i];
    Request& request = *request_ptr;
    Completion& completion = *completion_ptr;
    if (request.mark != mark) {
      request.mark = mark;
      touched.push_back(&request);
    }
    const SampledTokens& sampled = result.samples[i];
    count_speculation(request, sampled);
    for (size_t j = 0; j < sampled.token_ids.size(); ++j) {
      const int64_t token = sampled.token_ids[j];
      if (token < 0) {
        request.error = kNoDistribution;
        end_completion(completion, "error");
        break;
      }
      completion.output.token_ids.push_back(token);
      if (sampled.logprobs[j]) completion.output.logprobs.push_back(*sampled.logprobs[j]);
      RequestMetrics& m = request.metrics;
      if (m.first_token_time == 0.0) {
        m.first_token_time = t;
        stats_.time_to_first_token.observe(m.time_to_first_token());
      }
      m.last_token_time = t;
      ++m.num_generated_tokens;
      ++stats_.num_generated_tokens;
      const bool accepted_draft = static_cast<int64_t>(j) < sampled.num_accepted;
      if (!append_token(request, completion, token, accepted_draft, pending)) break;
    }
    // State-space layers ran every draft: a rejected one sends the sequence back (its state
    // restored) to recompute what it accepted.
    if (scheduler_.has_sequence(samples.seq_ids[i])) {
      scheduler_.settle_speculative_state(samples.seq_ids[i],
                                          sampled.num_accepted == sampled.num_draft_tokens);
    }
  }
  stats_.propose_seconds += result.propose_seconds;
  stats_.verify_seconds += result.verify_seconds;
  for (Request* request : touched) {
    if (finished_only && request->params.stop.empty() && !all_finished(*request)) continue;
    outputs.push_back(make_output(*request));
    if (outputs.back().finished) {
      retire(*request, t);
      outputs.back().metrics = request->metrics;
      requests_.erase(request->id);  // destroys *request
    }
  }
}

void ContinuousBatchingEngine::fail_if_stalled(std::vector<RequestOutput>& outputs) {
  if (requests_.empty() || ++num_idle_steps_ < 2) return;
  const double t = now();
  for (auto& [id, request] : requests_) {
    request->error = kNeverScheduled;
    for (Completion& completion : request->completions) {
      if (!completion.output.finished()) end_completion(completion, "error");
    }
    for (int64_t i = static_cast<int64_t>(request->completions.size()); i < request->params.n;
         ++i) {
      CompletionOutput output;
      output.index = i;
      output.finish_reason = "error";
      request->completions.push_back({-1, output, 0, RequestRandom(0), true});
    }
    outputs.push_back(make_output(*request));
    retire(*request, t);
    outputs.back().metrics = request->metrics;
  }
  requests_.clear();
  num_idle_steps_ = 0;
}

// ------------------------------------------------------------------------ request bookkeeping

void ContinuousBatchingEngine::end_completion(Completion& completion, const std::string& reason) {
  completion.output.finish_reason = reason;
  if (completion.forked && scheduler_.has_sequence(completion.seq_id)) {
    auto where = where_.find(completion.seq_id);
    if (where == where_.end() || !hold_blocks(*where->second.request, completion, reason)) {
      scheduler_.finish(completion.seq_id);
    }
  }
  where_.erase(completion.seq_id);
}

void ContinuousBatchingEngine::count_speculation(Request& request, const SampledTokens& sampled) {
  if (sampled.num_draft_tokens == 0) return;
  RequestMetrics& m = request.metrics;
  ++m.num_drafts;
  m.num_draft_tokens += sampled.num_draft_tokens;
  m.num_accepted_tokens += sampled.num_accepted;
  ++stats_.num_drafts;
  stats_.num_draft_tokens += sampled.num_draft_tokens;
  stats_.num_accepted_tokens += sampled.num_accepted;
  for (int64_t j = 0; j < sampled.num_accepted; ++j) ++stats_.accepted_per_position.at(j);
}

bool ContinuousBatchingEngine::append_token(Request& request, Completion& completion,
                                            int64_t token, bool kv_written, bool pending) {
  const SamplingParams& p = request.params;
  const int64_t generated = static_cast<int64_t>(completion.output.token_ids.size());
  const bool may_stop = generated >= p.min_tokens;
  if (may_stop && ((!p.ignore_eos && contains(config_.eos_token_ids, token)) ||
                   contains(p.stop_token_ids, token))) {
    end_completion(completion, "stop");
  } else if (generated >= p.max_tokens ||
             static_cast<int64_t>(request.prompt.size()) + generated >= config_.max_model_len) {
    end_completion(completion, "length");
  } else if (pending) {
    scheduler_.set_pending_token(completion.seq_id, static_cast<int32_t>(token));
    return true;
  } else {
    scheduler_.append_token(completion.seq_id, static_cast<int32_t>(token), kv_written);
    return true;
  }
  return false;
}

bool ContinuousBatchingEngine::all_finished(const Request& request) const {
  if (request.completions.size() != static_cast<size_t>(request.params.n)) return false;
  for (const Completion& c : request.completions) {
    if (!c.output.finished()) return false;
  }
  return true;
}

}  // namespace kvserve
