#pragma once
// The serving engine: requests join and leave at every step. Each step() asks the Scheduler for
// work under the token budget, runs one forward over the flattened mix of prefill chunks and
// decode tokens on the paged KV cache, samples the sequences that reached their last token, and
// reports what every request produced.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvserve/causal_lm.h"
#include "kvserve/paged_block_manager.h"
#include "kvserve/paged_kv_cache.h"
#include "kvserve/sampler.h"
#include "kvserve/sampling_params.h"
#include "kvserve/scheduler.h"

namespace kvserve {

struct EngineConfig {
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 2048;
  int64_t max_model_len = 0;  ///< 0: the model's max_position_embeddings
  int64_t block_size = 16;
  int64_t num_blocks = 0;     ///< KV pool size, null block included; required (>= 2)
  bool enable_prefix_caching = true;
  std::vector<int64_t> eos_token_ids;
};

/// Times of one request, in seconds of the monotonic clock (Python's time.monotonic()).
struct RequestMetrics {
  double arrival_time = 0.0;
  double first_scheduled_time = 0.0;
  double first_token_time = 0.0;
  double last_token_time = 0.0;
  double finished_time = 0.0;
  int64_t num_generated_tokens = 0;

  double time_to_first_token() const { return first_token_time - arrival_time; }
  double queue_time() const { return first_scheduled_time - arrival_time; }
  double e2e_latency() const { return finished_time - arrival_time; }
  /// Mean time between output tokens after the first (0 with fewer than 2 tokens).
  double time_per_output_token() const;
};

/// One sample of a request (index < SamplingParams::n).
struct CompletionOutput {
  int64_t index = 0;
  std::vector<int64_t> token_ids;      ///< everything generated so far
  std::vector<int64_t> new_token_ids;  ///< generated since the previous step() output
  std::string finish_reason;           ///< "" while running; "length", "stop" or "abort"
  /// When SamplingParams::logprobs is set: one entry per token of token_ids.
  std::vector<TokenLogprobs> logprobs;
  bool finished() const { return !finish_reason.empty(); }
};

/// What a request produced in one step (or its final state).
struct RequestOutput {
  std::string request_id;
  std::vector<int64_t> prompt_token_ids;
  std::vector<CompletionOutput> outputs;
  bool finished = false;
  int64_t num_cached_tokens = 0;  ///< prompt tokens whose KV came from the prefix cache
  RequestMetrics metrics;
};

struct EngineStats {
  int64_t num_running_requests = 0;
  int64_t num_waiting_requests = 0;
  int64_t num_running_sequences = 0;
  double kv_cache_usage = 0.0;  ///< fraction of usable blocks referenced
  int64_t prefix_cache_queries = 0;  ///< prompt tokens looked up
  int64_t prefix_cache_hits = 0;     ///< prompt tokens found
  int64_t num_preemptions = 0;
  int64_t num_finished_requests = 0;
  /// request id -> metrics of every finished request
  std::unordered_map<std::string, RequestMetrics> finished_metrics;
};

class ContinuousBatchingEngine {
 public:
  /// Allocates the paged KV cache (config.num_blocks blocks) for `model`. Throws
  /// std::invalid_argument on a bad config.
  ContinuousBatchingEngine(std::shared_ptr<CausalLM> model, EngineConfig config);

  /// Queues a request. Throws std::invalid_argument, changing nothing, for a duplicate id, an
  /// empty prompt, a token id outside the vocabulary, invalid params, or a request that could
  /// never fit: prompt + max_tokens beyond max_model_len or beyond the KV pool.
  void add_request(const std::string& request_id, const std::vector<int64_t>& prompt_token_ids,
                   const SamplingParams& params, std::optional<double> arrival_time = std::nullopt,
                   int64_t priority = 0);

  /// Runs one iteration; returns every request that produced tokens or finished in it (aborted
  /// requests are reported once, in the next step).
  std::vector<RequestOutput> step();

  bool has_unfinished_requests() const { return !requests_.empty(); }
  /// Stops a request and frees its blocks; false if the id is unknown or already finished.
  bool abort_request(const std::string& request_id);

  /// Ends one sample of a running request with `reason` (e.g. "stop" when the caller matched a
  /// stop string in its text) and frees its blocks; the request finishes with its last sample,
  /// silently (the caller already knows). Throws std::out_of_range for an unknown request or
  /// index; a no-op for a sample that already finished.
  void finish_completion(const std::string& request_id, int64_t index, const std::string& reason);

  EngineStats get_stats() const;
  const Scheduler& scheduler() const { return scheduler_; }
  const PagedBlockManager& block_manager() const { return block_manager_; }
  const PagedKVCache& kv_cache() const { return kv_cache_; }
  const EngineConfig& config() const { return config_; }
  CausalLM& model() { return *model_; }

 private:
  struct Completion {
    int64_t seq_id;
    CompletionOutput output;
    size_t num_reported = 0;  ///< token_ids already returned by step()
    RequestRandom random;
  };
  struct Request {
    std::string id;
    std::vector<int64_t> prompt;
    SamplingParams params;
    RequestMetrics metrics;
    std::vector<Completion> completions;  ///< one until the prompt's first sample, then n
    int64_t num_cached_tokens = 0;        ///< prefix-cache hit when first scheduled
  };

  void validate(const std::string& request_id, const std::vector<int64_t>& prompt,
                const SamplingParams& params) const;
  /// Forks completions 1..n-1 from completion 0 once the prompt is computed.
  void fork_samples(Request& request);
  /// Applies stop conditions after `token` was appended to `completion`.
  void check_stop(Request& request, Completion& completion, int64_t token);
  RequestOutput make_output(Request& request) const;
  /// Records a finished request's metrics and forgets it.
  void retire(const std::string& request_id, double finished_time);

  std::shared_ptr<CausalLM> model_;
  EngineConfig config_;
  PagedKVCache kv_cache_;
  PagedBlockManager block_manager_;
  Scheduler scheduler_;
  Sampler sampler_;
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::unordered_map<int64_t, Request*> request_of_seq_;
  std::vector<std::unique_ptr<Request>> aborted_;  ///< reported by the next step()
  std::unordered_map<std::string, RequestMetrics> finished_metrics_;
  int64_t next_seq_id_ = 0;
};

}  // namespace kvserve
