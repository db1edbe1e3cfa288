#pragma once
// Multi-token-prediction proposals: the target checkpoint's own MTP modules (models/mtp_head.h)
// draft from the target's hidden states. Module d's row at position p reads the hidden state at p
// (the target's for d = 0, module d - 1's after) and the token at p + d + 1, and predicts the
// token at p + d + 2. The rows sit in the modules' paged KV at position p, with the target's
// block ids: the row that reads the token at p + 1 is at p rather than p + 1 (as in vLLM), and
// since rotary attention scores depend only on distances, the scores equal those of the
// checkpoint's own layout (transformers' MtpModel), which has no row at position 0.
//
// Each step the proposer keeps the target's hidden states of the step's tokens (observe), and in
// the next step runs the modules over every position whose next tokens are now known (the
// catch-up: every sequence, drafting or not); a sequence that decodes then drafts one token per
// module from its last row, and more than there are modules by feeding the last module its own
// output and draft (its rows one position on, rewritten with the true ones a step later).
// A prefix-cache hit skips the target's hidden states of the positions it covers: the modules
// then attend over the rows the blocks hold from the sequence that computed them, whose last
// row read that sequence's next token. Drafts differ then, never the output.

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "kvserve/paged_kv_cache.h"
#include "kvserve/speculative_decoder.h"

namespace kvserve {

class MtpHead;

class MtpProposer : public Proposer {
 public:
  /// Allocates the modules' KV pool: num_blocks blocks of block_size tokens, one layer per module.
  MtpProposer(std::shared_ptr<MtpHead> head, int64_t num_blocks, int64_t block_size);

  Proposals propose(const ProposalContext& context) override;
  void observe(const SchedulerOutput& work, const std::vector<int64_t>& starts,
               const at::Tensor& hidden) override;

  const PagedKVCache& kv_cache() const { return kv_cache_; }

 private:
  std::shared_ptr<MtpHead> head_;
  PagedKVCache kv_cache_;
  /// What the proposer holds of one sequence.
  struct Track {
    int64_t num_admissions = 0;  ///< the sequence's SequenceState::num_admissions then
    int64_t first = 0;           ///< the position of hidden's first row
    /// The target's hidden states [rows, hidden] from `first` on that the modules have not
    /// read for good yet; undefined: none.
    at::Tensor hidden;
  };
  std::unordered_map<int64_t, Track> tracks_;
};

}  // namespace kvserve
