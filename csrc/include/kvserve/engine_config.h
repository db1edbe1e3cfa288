#pragma once
// How a ContinuousBatchingEngine is sized: batch limits, context length and the KV pool.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

#include "kvserve/model_config.h"
#include "kvserve/scheduler.h"
#include "kvserve/speculative_decoder.h"

namespace kvserve {

/// The KV pool's byte budget when neither num_blocks nor kv_cache_memory is given (vLLM's CPU
/// backend defaults to 4 GiB too); pages are committed only when first written.
constexpr int64_t kDefaultKVCacheMemory = int64_t{4} << 30;
/// EngineConfig::num_state_snapshots at most.
constexpr int64_t kMaxStateSnapshots = int64_t{1} << 20;

/// max_model_len's default for a model without attention layers (no position limit of its own).
constexpr int64_t kDefaultStateModelLen = 32768;

/// Limits and KV-pool size of one engine. Python's kvserve.EngineArgs fills it (one field per
/// option, the same names); resolve_engine_config() checks it and derives what was left 0.
struct EngineConfig {
  int64_t max_num_seqs = SchedulerConfig{}.max_num_seqs;  ///< running sequences at most
  /// Tokens per step (decodes + prefill chunks).
  int64_t max_num_batched_tokens = SchedulerConfig{}.max_num_batched_tokens;
  int64_t max_model_len = 0;  ///< prompt + output tokens at most; 0: max_position_embeddings
  int64_t block_size = 16;    ///< tokens per KV block
  /// KV pool size in blocks, null block included (>= 2); 0: sized from kv_cache_memory.
  int64_t num_blocks = 0;
  /// Bytes of the KV pool (with a draft model's pool) when num_blocks is 0; 0: room for
  /// max_num_seqs sequences of max_model_len tokens, at most kDefaultKVCacheMemory. A resolved
  /// config has num_blocks set and this 0.
  int64_t kv_cache_memory = 0;
  /// The pool's entries: the model's dtype when unset, or int8 / float8_e4m3fn with an fp32
  /// scale per token and KV head (kernels/cache/kv_cache_write.h). A draft model's pool keeps
  /// the draft's dtype.
  std::optional<at::ScalarType> kv_cache_dtype;
  /// The SSM states of a model with state-space layers: fp32 when unset, or the model's dtype
  /// (vLLM's --mamba-ssm-cache-dtype). The pool holds one state per running sequence
  /// (max_num_seqs) and num_state_snapshots more, within kv_cache_memory when that is given,
  /// else within kDefaultKVCacheMemory (more is refused).
  std::optional<at::ScalarType> ssm_state_dtype;
  /// Reuse of cached prompt blocks. For a model with state-space layers only with
  /// num_state_snapshots > 0 (a hit resumes from a state saved at its last block); off otherwise.
  bool enable_prefix_caching = true;
  /// A model with state-space layers: slots of the state pool, beyond max_num_seqs, that keep
  /// states saved at block boundaries for prefix hits (PagedBlockManager's snapshots; prefill
  /// chunks then end at block boundaries). 0: prefix caching off for such a model.
  int64_t num_state_snapshots = 0;
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
  /// Launch each step before the previous one's samples reach the host (vLLM's async
  /// scheduling): a step's tokens feed the next on the device, and step() returns the previous
  /// step's outputs while the device runs the new one. Not with speculative decoding
  /// (refused), nor tensor parallelism (the engine refuses).
  bool async_scheduling = false;
};

/// `config` checked against the model that will run it (its config and weight dtype) and an
/// optional draft model, with max_model_len and num_blocks derived where 0. Throws
/// std::invalid_argument naming the first bad option. Idempotent: the engine calls it again.
EngineConfig resolve_engine_config(EngineConfig config, const ModelConfig& model,
                                   at::ScalarType dtype, const ModelConfig* draft = nullptr);

/// add_request's refusal when max_waiting_requests requests already wait: the request is fine,
/// the engine is busy (kvserve.EngineOverloadedError in Python; retry later).
class EngineOverloaded : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvserve
