#pragma once
// Prompt lookup (n-gram) proposals: no model. The longest suffix of a sequence (between
// prompt_lookup_min and prompt_lookup_max tokens) that also occurs earlier in its prompt + output
// proposes the tokens that followed its latest earlier occurrence. Pays off when the output copies
// its input (code edits, quoting, extraction); each draft is a point mass for verification.

#include <cstdint>
#include <vector>

#include "kvserve/speculative_decoder.h"

namespace kvserve {

class NgramProposer : public Proposer {
 public:
  /// 1 <= min_n <= max_n; throws std::invalid_argument.
  NgramProposer(int64_t min_n, int64_t max_n);

  Proposals propose(const ProposalContext& context) override;

  /// Up to max_tokens tokens following the latest earlier occurrence of the longest suffix of
  /// `tokens` with min_n..max_n tokens; empty when no such suffix recurs.
  std::vector<int64_t> lookup(const std::vector<int32_t>& tokens, int64_t max_tokens) const;

 private:
  int64_t min_n_, max_n_;
};

}  // namespace kvserve
