#include "engine/draft_sampling.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/masked_fill.h>
#include <ATen/ops/max.h>

#include <deque>

#include "engine/engine_helpers.h"

namespace kvserve::draft_sampling {

using engine_helpers::to_tensor;

void copy_blocks(PagedKVCache& pool, const SchedulerOutput& work) {
  std::vector<std::pair<int32_t, int32_t>> copies;
  for (const BlockCopy& c : work.block_copies) copies.emplace_back(c.src, c.dst);
  pool.copy_blocks(copies);
}

DraftRounds::DraftRounds(const ProposalContext& context, Proposals& out,
                         const std::vector<size_t>& drafting)
    : context_(context), out_(out) {
  for (size_t entry : drafting) {
    const SamplingParams& params = *context.rows[entry]->params;
    greedy_ = greedy_ && params.temperature < SamplingParams::kGreedyTemperature;
    argmax_only_ = argmax_only_ && !params.changes_logits();
  }
  argmax_only_ = argmax_only_ && greedy_;
}

std::vector<bool> DraftRounds::sample(at::Tensor logits, const std::vector<size_t>& entries) {
  at::Tensor tokens;
  Round round;
  if (argmax_only_) {
    // The sampler's greedy draw without its pass: a row whose largest logit is -inf or NaN has
    // no distribution (-1), as the sampler reports it.
    auto [best, index] = at::max(logits, 1);
    tokens = index.masked_fill(best.isfinite().logical_not(), -1).cpu();
  } else {
    std::deque<std::vector<int64_t>> histories;
    std::deque<SamplingParams> without_logprobs;
    std::vector<SamplingRow> rows;
    for (size_t entry : entries) {
      const auto& so_far = out_.tokens[entry];
      SamplingRow row = row_after_drafts(*context_.rows[entry], so_far, so_far.size(),
                                         histories.emplace_back());
      if (row.params->logprobs) {  // a draft's logprobs are never returned
        row.params = &without_logprobs.emplace_back(*row.params);
        without_logprobs.back().logprobs.reset();
      }
      rows.push_back(row);
    }
    SamplerOutput sampled = sampler_.sample(logits, rows, /*want_probs=*/!greedy_);
    tokens = sampled.token_ids;
    round.probs = sampled.probs;
  }
  std::vector<bool> drafted(entries.size(), false);
  const int64_t* token = tokens.data_ptr<int64_t>();
  for (size_t a = 0; a < entries.size(); ++a) {
    if (token[a] < 0) continue;  // no distribution here
    auto& so_far = out_.tokens[entries[a]];
    round.source_rows.push_back(static_cast<int64_t>(a));
    round.at.emplace_back(entries[a], so_far.size());
    so_far.push_back(token[a]);
    drafted[a] = true;
  }
  if (!greedy_) rounds_.push_back(std::move(round));
  return drafted;
}

void DraftRounds::finish(int64_t vocab_size, at::Device device) {
  std::vector<int64_t> offset(out_.tokens.size(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < out_.tokens.size(); ++i) {
    offset[i] = total;
    total += static_cast<int64_t>(out_.tokens[i].size());
  }
  if (total == 0 || rounds_.empty()) return;
  out_.probs = at::empty({total, vocab_size}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const Round& round : rounds_) {
    if (round.source_rows.empty()) continue;
    std::vector<int64_t> dest;
    for (auto [entry, index] : round.at) dest.push_back(offset[entry] + static_cast<int64_t>(index));
    out_.probs.index_copy_(0, to_tensor(dest, device),
                           round.probs.index_select(0, to_tensor(round.source_rows, device)));
  }
}

}  // namespace kvserve::draft_sampling
