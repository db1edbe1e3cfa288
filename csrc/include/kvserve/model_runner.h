#pragma once
// Runs a model over batches of requests: builds the flattened batch tensors, runs one forward per
// step, samples, and applies stop conditions. This is the static-batching runner: a batch is
// admitted together and runs until its last request finishes (finished rows leave the batch).
// KV lives in a PagedKVCache whose blocks a PagedBlockManager hands out; the pool and its prefix
// cache persist across generate() calls.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "kvserve/causal_lm.h"
#include "kvserve/paged_block_manager.h"
#include "kvserve/paged_kv_cache.h"
#include "kvserve/sampler.h"
#include "kvserve/sampling_params.h"

namespace kvserve {

/// One prompt to complete.
struct GenerationRequest {
  std::vector<int64_t> prompt_token_ids;
  SamplingParams params;
};

/// What a request produced. Times are seconds on the monotonic clock (Python time.monotonic()).
struct GenerationResult {
  std::vector<int64_t> token_ids;
  std::string finish_reason;  ///< "stop" (EOS or a stop token) or "length"
  double start_time = 0.0;        ///< when its batch started
  double first_token_time = 0.0;  ///< when its first token was sampled
  double finish_time = 0.0;
  int64_t num_cached_tokens = 0;  ///< prompt tokens whose KV came from the prefix cache
};

/// How the runner's paged KV cache is sized.
struct KVCacheConfig {
  int64_t block_size = 16;
  /// Blocks in the pool, null block included; 0 = enough for max_num_seqs sequences of
  /// max_model_len tokens.
  int64_t num_blocks = 0;
  bool enable_prefix_caching = true;
};

/// Static-batch generation over a CausalLM with a paged KV cache.
class ModelRunner {
 public:
  /// max_model_len: longest prompt + output; max_num_seqs: rows per batch (larger request lists
  /// run as consecutive batches, and a batch also stops growing when the KV pool could not hold
  /// its requests at full length); eos_token_ids end a request unless ignore_eos.
  ModelRunner(std::shared_ptr<CausalLM> model, int64_t max_model_len, int64_t max_num_seqs,
              std::vector<int64_t> eos_token_ids, KVCacheConfig cache_config = {});

  /// Completes every request; results in request order. Validates all requests before running
  /// any: throws std::invalid_argument for an empty prompt, a token id outside the vocabulary,
  /// a prompt of max_model_len tokens or more, or invalid SamplingParams.
  std::vector<GenerationResult> generate(const std::vector<GenerationRequest>& requests);

  /// Throws std::invalid_argument if `request` could not run (the checks of generate()),
  /// including one whose prompt + max_tokens could never fit in the KV pool.
  void validate(const GenerationRequest& request) const;

  CausalLM& model() { return *model_; }
  int64_t max_model_len() const { return max_model_len_; }
  const PagedKVCache& kv_cache() const { return kv_cache_; }
  const PagedBlockManager& block_manager() const { return block_manager_; }

 private:
  /// Tokens request r may occupy: prompt + max_tokens, at most max_model_len.
  int64_t full_length(const GenerationRequest& r) const;
  /// One past the last request (from `begin`) of the next batch.
  size_t batch_end(const std::vector<GenerationRequest>& requests, size_t begin) const;
  void run_batch(const std::vector<GenerationRequest>& requests, size_t begin, size_t end,
                 std::vector<GenerationResult>& results);

  std::shared_ptr<CausalLM> model_;
  int64_t max_model_len_;
  int64_t max_num_seqs_;
  std::vector<int64_t> eos_token_ids_;
  PagedKVCache kv_cache_;
  PagedBlockManager block_manager_;
  int64_t next_seq_id_ = 0;
  Sampler sampler_;
};

}  // namespace kvserve
