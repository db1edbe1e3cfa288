// DraftModelProposer: one draft forward over the step's tokens (its KV catching up with the
// target's), then one per further draft position over the speculating sequences only.
#include "kvserve/draft_model_proposer.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <deque>

#include "engine/engine_helpers.h"
#include "kvserve/forward_batch.h"

namespace kvserve {

using engine_helpers::make_kv_cache;
using engine_helpers::to_tensor;

namespace {

// Where one speculating entry stands in the draft loop.
struct Drafting {
  size_t entry;        // index into work.scheduled
  int64_t last;        // position of the last token fed so far
  int64_t wanted;      // draft slots
  bool done = false;
};

}  // namespace

DraftModelProposer::DraftModelProposer(std::shared_ptr<CausalLM> draft, int64_t num_blocks,
                                       int64_t block_size)
    : draft_(std::move(draft)), kv_cache_(make_kv_cache(*draft_, num_blocks, block_size)) {}

Proposals DraftModelProposer::propose(const ProposalContext& context) {
  const SchedulerOutput& work = context.work;
  Proposals out;
  out.tokens.resize(work.scheduled.size());

  std::vector<std::pair<int32_t, int32_t>> copies;
  for (const BlockCopy& c : work.block_copies) copies.emplace_back(c.src, c.dst);
  kv_cache_.copy_blocks(copies);
  // A sequence that lost its blocks (finished, or preempted and readmitted: other blocks)
  // starts over when it runs again.
  for (auto it = written_.begin(); it != written_.end();) {
    const bool same = context.sequences.contains(it->first) &&
                      context.sequences.at(it->first).num_admissions == it->second.num_admissions;
    it = same ? std::next(it) : written_.erase(it);
  }
  bool any = false;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    any = any || (context.rows[i] && work.scheduled[i].num_speculative_tokens > 0);
  }
  if (!any) return out;  // the draft does not run; it catches up when it next does

  // The catch-up forward: every scheduled sequence from where its draft KV ends. A sequence the
  // draft has not seen since it got its blocks starts at 0, prefix-cache hits included: the draft
  // computes its own KV for every position it reads (rewriting a shared block's positions with
  // the same values), so its proposals never depend on what other sequences left in the pool.
  ForwardBatchBuilder builder(kv_cache_.block_size());
  std::vector<Drafting> drafting;
  std::vector<int64_t> hidden_rows;
  int64_t num_rows = 0;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    const SequenceState& sequence = context.sequences.at(s.seq_id);
    const auto& tokens = sequence.token_ids;
    const int64_t end = s.num_computed + s.num_new_tokens;
    Written& written = written_[s.seq_id];
    const int64_t start = written.num_admissions == sequence.num_admissions
                              ? std::min(written.num_computed, s.num_computed)
                              : 0;
    builder.add(std::vector<int64_t>(tokens.begin() + start, tokens.begin() + end), start,
                s.block_tables.at(0));
    num_rows += end - start;
    written = {sequence.num_admissions, end};
    if (context.rows[i] && s.num_speculative_tokens > 0 && s.samples) {
      drafting.push_back({i, end - 1, s.num_speculative_tokens});
      hidden_rows.push_back(num_rows - 1);
    }
  }
  ForwardBatch batch = builder.build(draft_->device());
  at::Tensor hidden =
      draft_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
  const at::Device device = hidden.device();

  // One sampling round per draft position; round r's probabilities fill rows of out.probs later.
  struct Round {
    at::Tensor probs;
    std::vector<int64_t> source_rows;           // rows of `probs` that became drafts
    std::vector<std::pair<size_t, size_t>> at;  // their (entry, draft index)
  };
  std::vector<Round> rounds;
  std::vector<Drafting*> active;
  for (Drafting& d : drafting) active.push_back(&d);
  while (!active.empty()) {
    at::Tensor logits = draft_->compute_logits(hidden.index_select(0, to_tensor(hidden_rows, device)));
    std::deque<std::vector<int64_t>> histories;
    std::vector<SamplingRow> rows;
    for (Drafting* d : active) {
      const auto& so_far = out.tokens[d->entry];
      rows.push_back(row_after_drafts(*context.rows[d->entry], so_far, so_far.size(),
                                      histories.emplace_back()));
    }
    SamplerOutput sampled = sampler_.sample(logits, rows, /*want_probs=*/true);
    Round round;
    round.probs = sampled.probs;
    ForwardBatchBuilder next(kv_cache_.block_size());
    std::vector<Drafting*> still;
    const int64_t* token = sampled.token_ids.data_ptr<int64_t>();
    for (size_t a = 0; a < active.size(); ++a) {
      Drafting& d = *active[a];
      auto& so_far = out.tokens[d.entry];
      if (token[a] < 0) continue;  // the draft has no distribution here: stop drafting
      round.source_rows.push_back(static_cast<int64_t>(a));
      round.at.emplace_back(d.entry, so_far.size());
      so_far.push_back(token[a]);
      if (static_cast<int64_t>(so_far.size()) == d.wanted) continue;
      // Feed it: its KV goes to the next draft slot, its logits give the next draft.
      ++d.last;
      next.add({token[a]}, d.last, work.scheduled[d.entry].block_tables.at(0));
      written_[work.scheduled[d.entry].seq_id].num_computed = d.last + 1;
      still.push_back(&d);
    }
    rounds.push_back(std::move(round));
    active = std::move(still);
    if (active.empty()) break;
    batch = next.build(device);
    hidden = draft_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
    hidden_rows.resize(active.size());
    for (size_t a = 0; a < active.size(); ++a) hidden_rows[a] = static_cast<int64_t>(a);
  }

  // Gather the probabilities in the order of out.tokens.
  std::vector<int64_t> offset(work.scheduled.size(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    offset[i] = total;
    total += static_cast<int64_t>(out.tokens[i].size());
  }
  if (total == 0) return out;
  out.probs = at::empty({total, draft_->config().vocab_size}, hidden.options().dtype(at::kFloat));
  for (Round& round : rounds) {
    if (round.source_rows.empty()) continue;
    std::vector<int64_t> dest;
    for (auto [entry, index] : round.at) dest.push_back(offset[entry] + static_cast<int64_t>(index));
    out.probs.index_copy_(0, to_tensor(dest, device),
                          round.probs.index_select(0, to_tensor(round.source_rows, device)));
  }
  return out;
}

}  // namespace kvserve
