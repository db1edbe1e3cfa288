#pragma once
// Counters and gauges of a serving engine, cheap to read at any time: get_stats() copies a fixed
// number of values, however many requests the engine has served.

#include <array>
#include <cstdint>
#include <vector>

namespace kvserve {

/// A latency distribution in fixed buckets (seconds), Prometheus-style: counts[i] holds the
/// observations <= kBounds[i] not counted in an earlier bucket; the last bucket is +inf.
struct LatencyHistogram {
  static constexpr std::array<double, 14> kBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                     0.25,  0.5,    1.0,   2.5,  5.0,   10.0, 30.0};
  std::array<int64_t, kBounds.size() + 1> counts{};
  int64_t count = 0;
  double sum = 0.0;

  void observe(double seconds);
};

/// A snapshot of the engine: gauges as of its last step, counters since it started.
struct EngineStats {
  int64_t num_running_requests = 0;   ///< with at least one sequence holding KV blocks
  int64_t num_waiting_requests = 0;   ///< unfinished and not running
  int64_t num_running_sequences = 0;
  double kv_cache_usage = 0.0;        ///< fraction of usable blocks referenced
  int64_t prefix_cache_queries = 0;   ///< prompt tokens looked up
  int64_t prefix_cache_hits = 0;      ///< prompt tokens found
  int64_t num_preemptions = 0;
  int64_t num_finished_requests = 0;  ///< every finish reason, aborts and errors included
  int64_t num_aborted_requests = 0;
  int64_t num_failed_requests = 0;    ///< ended with finish_reason "error"
  int64_t num_steps = 0;              ///< steps that ran a forward
  int64_t num_cuda_graph_steps = 0;   ///< of which the forward replayed a CUDA graph
  /// Of which launched before the previous step's samples were taken (async scheduling).
  int64_t num_async_steps = 0;
  int64_t num_generated_tokens = 0;
  int64_t num_computed_prompt_tokens = 0;  ///< prompt tokens a forward computed (recomputes too)
  int64_t num_loaded_prompt_tokens = 0;    ///< prompt tokens whose KV a transfer brought
  int64_t num_loading_requests = 0;        ///< waiting for their prompt's KV to arrive
  int64_t num_held_requests = 0;           ///< finished, holding their KV for another engine
  LatencyHistogram time_to_first_token;  ///< of requests that produced a token
  LatencyHistogram time_per_output_token;  ///< of finished requests with 2+ tokens
  LatencyHistogram e2e_latency;            ///< of finished requests

  // Speculative decoding, vLLM's definitions: a draft is one sequence's proposal in one step.
  int64_t num_drafts = 0;
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
  /// accepted_per_position[j]: drafts whose token j (0-based) was accepted; k entries.
  std::vector<int64_t> accepted_per_position;
  double propose_seconds = 0.0;  ///< in the proposer (draft model or n-gram lookup)
  double verify_seconds = 0.0;   ///< forward + sampling of the steps that verified drafts
};

}  // namespace kvserve
