// ContinuousBatchingEngine, asynchronous scheduling (EngineConfig::async_scheduling): step N + 1
// is scheduled and launched before step N's samples reach the host, so that the host's part of a
// step (scheduling, the batch, the outputs, Python) runs while the device computes.
//
// A sequence sampled by a launched step ends with a kPendingToken: the next schedule() gives it
// its slot as if the token were known, and the next launch feeds it on the device from the
// launched step's tokens (TokenFeed). After that launch, the launched step's samples are taken as
// a synchronous step takes its own, setting each kPendingToken's value. A sequence that one of
// them ends (a stop token, a stop string, an abort) was already fed to the newer step: its row
// there is computed and dropped. One whose next token ends it by length gets no kPendingToken,
// so that nothing is scheduled past its limits.
#include <exception>
#include <string>
#include <unordered_map>
#include <utility>

#include "engine/engine_helpers.h"
#include "kvserve/continuous_batching_engine.h"

namespace kvserve {

using engine_helpers::message_of;

void ContinuousBatchingEngine::launch_step(SchedulerOutput work, StepSamples samples,
                                           std::vector<RequestOutput>& outputs,
                                           bool finished_only) {
  TokenFeed feed;
  if (in_flight_) {
    feed.tokens = in_flight_->launched.samples.token_ids;
    std::unordered_map<int64_t, int64_t> source;  // seq id -> its row of the launched samples
    const LaunchedWork& previous = *in_flight_;
    for (size_t i = 0; i < previous.samples.seq_ids.size(); ++i) {
      source[previous.samples.seq_ids[i]] = static_cast<int64_t>(i);
    }
    int64_t row = 0;
    std::unordered_map<int64_t, int64_t> pending_source;  // seq id -> its pending token's entry
    for (const ScheduledSequence& s : work.scheduled) {
      for (const int32_t token : s.token_ids) {
        if (token == kPendingToken) {
          const auto found = source.find(s.seq_id);
          if (found == source.end()) {
            throw std::logic_error("launch_step: sequence " + std::to_string(s.seq_id) +
                                   " has a pending token that no launched step samples");
          }
          feed.rows.push_back(row);
          feed.sources.push_back(found->second);
          pending_source[s.seq_id] = found->second;
        }
        ++row;
      }
    }
    // The sampler counts each sequence's pending token in its history (penalties, min_tokens).
    for (SamplingTarget& target : samples.targets) {
      const auto found = pending_source.find(work.scheduled[target.scheduled_index].seq_id);
      if (found != pending_source.end()) target.row.pending_source = found->second;
    }
  }
  LaunchedStep launched;
  try {
    if (num_injected_failures_.load() > 0) {
      --num_injected_failures_;
      throw std::runtime_error("an injected step failure (inject_step_failures)");
    }
    launched = runner_.launch(work, samples.targets, samples.prompt_targets, feed);
  } catch (...) {
    fail_step(&work, message_of(std::current_exception()));
    throw;
  }
  if (in_flight_) finish_in_flight(outputs, finished_only);
  // The launched step's bookkeeping, now that the tokens it was fed are all known: the sequences
  // that the last samples ended are left out (their rows' results are dropped).
  SchedulerOutput live = work;
  std::erase_if(live.scheduled, [&](const ScheduledSequence& s) {
    return !scheduler_.has_sequence(s.seq_id);
  });
  advance(live, launched.cuda_graph);
  ++stats_.num_async_steps;
  fork_samples(samples);  // a prompt's n samples, each with its own pending token below
  for (size_t k = 0; k < samples.prompt_requests.size(); ++k) {
    std::vector<TokenLogprobs>& scored = samples.prompt_requests[k]->prompt_logprobs;
    scored.insert(scored.end(), launched.prompt_logprobs[k].begin(),
                  launched.prompt_logprobs[k].end());
  }
  launched.prompt_logprobs.clear();
  for (const int64_t seq_id : samples.seq_ids) {
    const auto where = where_.find(seq_id);
    if (where == where_.end()) continue;
    const Request& request = *where->second.request;
    const Completion& completion = request.completions[where->second.completion];
    // append_token's length limits, one token ahead: such a token ends the sequence.
    const int64_t generated = static_cast<int64_t>(completion.output.token_ids.size()) + 1;
    if (generated >= request.params.max_tokens ||
        static_cast<int64_t>(request.prompt.size()) + generated >= config_.max_model_len) {
      continue;
    }
    scheduler_.append_token(seq_id, kPendingToken);
  }
  in_flight_.emplace(LaunchedWork{std::move(work), std::move(samples), std::move(launched)});
}

void ContinuousBatchingEngine::finish_in_flight(std::vector<RequestOutput>& outputs,
                                                bool finished_only) {
  ModelRunnerOutput result;
  try {
    result = runner_.finish(in_flight_->launched);
  } catch (...) {
    fail_step(nullptr, message_of(std::current_exception()));
    throw;
  }
  const LaunchedWork step = std::move(*in_flight_);
  in_flight_.reset();
  take_samples(step.work, step.samples, result, outputs, finished_only, /*pending=*/true);
}

}  // namespace kvserve
