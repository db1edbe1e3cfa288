#pragma once
// Draft-model proposals: a second, smaller CausalLM of the target's vocabulary runs k steps per
// speculating sequence, all in C++. Its paged KV pool has the target's shape in blocks: the same
// block ids through the step's block tables, so allocation, copy-on-write and freeing need
// nothing of their own. In each step that speculates it first runs over the tokens of the step's
// sequences that its KV lacks (the step's new tokens, or a whole sequence it has not seen since
// the sequence got its blocks), then proposes.

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
  /// runs the draft over every scheduled sequence's tokens that its KV lacks, and samples each
  /// speculating sequence's drafts from its own row, one draft forward per draft position.
  Proposals propose(const ProposalContext& context) override;

  const PagedKVCache& kv_cache() const { return kv_cache_; }
  CausalLM& model() { return *draft_; }

 private:
  std::shared_ptr<CausalLM> draft_;
  PagedKVCache kv_cache_;
  /// What the draft's KV holds of one sequence.
  struct Written {
    int64_t num_admissions = 0;  ///< the sequence's SequenceState::num_admissions then
    /// Leading positions whose draft KV it wrote (it may run ahead of the target's computed
    /// count by rejected drafts; the next run starts at the smaller).
    int64_t num_computed = 0;
  };
  /// Per sequence the draft ran over; a sequence readmitted since (other blocks) starts over.
  std::unordered_map<int64_t, Written> written_;
};

}  // namespace kvserve
