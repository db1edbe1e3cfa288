#pragma once
// Draft-model proposals: a second, smaller CausalLM of the target's vocabulary runs k steps per
// speculating sequence, all in C++. Its paged KV pool mirrors the target's: same number of blocks,
// same block size, same block ids (the scheduler's block tables serve both), so prefix caching,
// copy-on-write and preemption need nothing of their own. Every step it runs over the tokens the
// target runs over (prompts included), then proposes.

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "kvserve/causal_lm.h"
#include "kvserve/paged_kv_cache.h"
#include "kvserve/speculative_decoder.h"

namespace kvserve {

class DraftModelProposer : public Proposer {
 public:
  /// Allocates the draft's KV pool: num_blocks blocks of block_size tokens.
  DraftModelProposer(std::shared_ptr<CausalLM> draft, int64_t num_blocks, int64_t block_size);

  /// Applies the step's copy-on-write copies to the draft pool; when some entry has draft slots,
  /// runs the draft over every scheduled sequence's new tokens (and any it has not seen: after a
  /// step whose drafts were all accepted, or one without speculation) and samples each speculating
  /// sequence's drafts from its own row, one draft forward per draft position.
  Proposals propose(const ProposalContext& context) override;

  const PagedKVCache& kv_cache() const { return kv_cache_; }
  CausalLM& model() { return *draft_; }

 private:
  std::shared_ptr<CausalLM> draft_;
  PagedKVCache kv_cache_;
  Sampler sampler_;
  /// Per sequence: the leading positions whose draft KV is written (it may run ahead of the
  /// target's computed count by rejected drafts; the start of the next draft run is the smaller).
  std::unordered_map<int64_t, int64_t> num_computed_;
};

}  // namespace kvserve
