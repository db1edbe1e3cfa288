#pragma once
// How a ContinuousBatchingEngine is sized: batch limits, context length and the KV pool.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

#include "kvserve/speculative_decoder.h"

namespace kvserve {

/// Limits and KV-pool size of one engine.
struct EngineConfig {
  int64_t max_num_seqs = 256;            ///< running sequences at most
  int64_t max_num_batched_tokens = 2048;  ///< tokens per step (decodes + prefill chunks)
  int64_t max_model_len = 0;  ///< prompt + output tokens at most; 0: max_position_embeddings
  int64_t block_size = 16;    ///< tokens per KV block
  int64_t num_blocks = 0;     ///< KV pool size, null block included; required (>= 2)
  /// The pool's entries: the model's dtype when unset, or int8 / float8_e4m3fn with an fp32
  /// scale per token and KV head (kernels/cache/kv_cache_write.h). A draft model's pool keeps
  /// the draft's dtype.
  std::optional<at::ScalarType> kv_cache_dtype;
  bool enable_prefix_caching = true;
  std::vector<int64_t> eos_token_ids;
  int64_t max_logprobs = 20;  ///< SamplingParams::logprobs at most (vLLM's default)
  SpeculativeConfig speculative;  ///< off unless speculative.method is set
  /// A model on a CUDA device replays CUDA graphs for decode steps of up to this many
  /// sequences (CudaGraphRunner); 0: every step launches its kernels one by one.
  int64_t cuda_graph_max_batch = 0;
  /// Per request at most this many stop strings (each is matched against every sample's new
  /// text at every step). 0: no limit. (Stop token ids are bounded by the vocabulary.)
  int64_t max_stop_strings = 64;
  /// A stop string's length at most, in characters (Unicode code points). 0: no limit.
  int64_t max_stop_string_length = 1024;
  /// Requests queued or waiting to run at most; add_request beyond it throws EngineOverloaded
  /// (a server's 429). 0: no limit (LLM.generate submits every prompt at once).
  int64_t max_waiting_requests = 0;
};

/// add_request's refusal when max_waiting_requests requests already wait: the request is fine,
/// the engine is busy (kvserve.EngineOverloadedError in Python; retry later).
class EngineOverloaded : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvserve
