// Prompt lookup: one backward scan per sequence for the latest, longest earlier occurrence of its
// suffix.
#include "kvserve/ngram_proposer.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvserve {

NgramProposer::NgramProposer(int64_t min_n, int64_t max_n) : min_n_(min_n), max_n_(max_n) {
  if (min_n < 1 || max_n < min_n) {
    throw std::invalid_argument("NgramProposer: need 1 <= min_n <= max_n, got " +
                                std::to_string(min_n) + " and " + std::to_string(max_n));
  }
}

std::vector<int64_t> NgramProposer::lookup(const std::vector<int32_t>& tokens,
                                           int64_t max_tokens) const {
  const int64_t len = static_cast<int64_t>(tokens.size());
  if (len < 2 || max_tokens < 1) return {};
  // Candidate ends e < len - 1 of an earlier occurrence: the match length m counts back from e
  // and from the last token together. The first e reaching max_n is the latest longest match.
  int64_t best_m = 0, best_end = -1;
  const int32_t last = tokens[len - 1];
  for (int64_t e = len - 2; e >= 0; --e) {
    if (tokens[e] != last) continue;
    int64_t m = 1;
    while (m < max_n_ && e - m >= 0 && tokens[e - m] == tokens[len - 1 - m]) ++m;
    if (m > best_m) {
      best_m = m;
      best_end = e;
      if (m == max_n_) break;
    }
  }
  if (best_m < min_n_) return {};
  const int64_t begin = best_end + 1;  // <= len - 1: at least one token follows
  const int64_t end = std::min(len, begin + max_tokens);
  return std::vector<int64_t>(tokens.begin() + begin, tokens.begin() + end);
}

Proposals NgramProposer::propose(const ProposalContext& context) {
  Proposals out;
  out.tokens.resize(context.work.scheduled.size());
  for (size_t i = 0; i < context.work.scheduled.size(); ++i) {
    const ScheduledSequence& s = context.work.scheduled[i];
    if (!context.rows[i] || s.num_speculative_tokens == 0) continue;
    out.tokens[i] = lookup(context.sequences.at(s.seq_id).token_ids, s.num_speculative_tokens);
  }
  return out;
}

}  // namespace kvserve
