#pragma once
// What the engine reports about a request: its times, and per step the tokens each of its samples
// produced. Python's kvserve.RequestOutput / CompletionOutput add the detokenized text to these
// and keep every field's meaning; kvserve.RequestMetrics is this RequestMetrics.

#include <cstdint>
#include <string>
#include <vector>

#include "kvserve/sampler.h"

namespace kvserve {

/// Times of one request, in seconds of the monotonic clock (Python's time.monotonic()). A time
/// that has not happened yet is 0. Once set, arrival <= first_scheduled <= first_token <=
/// last_token <= finished.
struct RequestMetrics {
  double arrival_time = 0.0;
  double first_scheduled_time = 0.0;  ///< the first step that ran any of its tokens
  double first_token_time = 0.0;
  double last_token_time = 0.0;
  double finished_time = 0.0;  ///< 0 until every sample finished (or the request was aborted)
  int64_t num_generated_tokens = 0;  ///< over all samples
  // Speculative decoding (vLLM's definitions), over all samples: times drafts were verified,
  // draft tokens verified, and those accepted. Mean acceptance length = 1 + accepted / drafts.
  int64_t num_drafts = 0;
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;

  /// TTFT: arrival to the first sampled token (0 before it).
  double time_to_first_token() const;
  /// Arrival to the first step that ran it (0 before that step).
  double queue_time() const;
  /// Arrival to finished (0 while running).
  double e2e_latency() const;
  /// TPOT: mean time between output tokens after the first (0 with fewer than 2 tokens).
  double time_per_output_token() const;
};

/// One sample of a request (index < SamplingParams::n).
struct CompletionOutput {
  int64_t index = 0;
  /// Everything generated, in the output that reports the sample finished; a running sample's
  /// step outputs leave it empty and carry new_token_ids (a copy of the whole history every
  /// step made a stream's cost quadratic in its length), as logprobs below.
  std::vector<int64_t> token_ids;
  std::vector<int64_t> new_token_ids;  ///< generated since the previous step() output
  /// "" while running; "length", "stop", "abort", or "error" (see RequestOutput::error).
  std::string finish_reason;
  /// When SamplingParams::logprobs is set: one entry per token of token_ids, in the output that
  /// reports the sample finished; a running sample's step outputs leave it empty and carry
  /// new_logprobs (copying every earlier entry each step made a step's cost grow with the
  /// output's length: 1.6 -> 8.4 ms a step over 256 tokens of 64 sequences).
  std::vector<TokenLogprobs> logprobs;
  /// When SamplingParams::logprobs is set: one entry per token of new_token_ids.
  std::vector<TokenLogprobs> new_logprobs;
  bool finished() const { return !finish_reason.empty(); }
};

/// What a request produced in one step (or its final state).
struct RequestOutput {
  std::string request_id;
  std::vector<int64_t> prompt_token_ids;
  std::vector<CompletionOutput> outputs;
  bool finished = false;
  int64_t num_cached_tokens = 0;  ///< prompt tokens whose KV came from the prefix cache
  /// When SamplingParams::prompt_logprobs is set: one entry per prompt token after the first
  /// (token_id is that prompt token), in the first output after the whole prompt was scored and
  /// in the final output; empty in the others.
  std::vector<TokenLogprobs> prompt_logprobs;
  RequestMetrics metrics;
  /// Why a sample ended with finish_reason "error" (e.g. its logits held NaN, or it could never
  /// be scheduled); "" otherwise.
  std::string error;
};

}  // namespace kvserve
