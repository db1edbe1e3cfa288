#include "kvserve/model_runner.h"


#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"
#include "kvserve/forward_batch.h"

namespace kvserve {

using engine_helpers::make_kv_cache;
using engine_helpers::to_tensor;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

namespace {

// Whether the block manager runs groups of layers with sliding windows (then the pool's layers
// are grouped the same way).
bool grouped(const PagedBlockManager& blocks) {
  return blocks.num_groups() > 1 || blocks.group_window(0) > 0;
}

}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<CausalLM> model, int64_t num_blocks, int64_t block_size,
                         const Scheduler& scheduler, SpeculativeDecoder* speculator,
                         std::optional<at::ScalarType> kv_cache_dtype,
                         int64_t cuda_graph_max_batch, int64_t max_model_len)
    : model_(std::move(model)),
      kv_cache_(make_kv_cache(*model_, num_blocks, block_size, grouped(scheduler.block_manager()),
                              kv_cache_dtype)),
      scheduler_(scheduler),
      speculator_(speculator) {
  std::vector<int64_t> windows;
  for (int64_t g = 0; g < scheduler.block_manager().num_groups(); ++g) {
    windows.push_back(scheduler.block_manager().group_window(g));
  }
  if (windows != kv_cache_.layout().group_windows()) {
    throw std::invalid_argument("ModelRunner: the block manager's groups of layers do not match "
                                "the model's sliding windows");
  }
  if (cuda_graph_max_batch > 0 && max_model_len > 0 && CudaGraphRunner::supports(*model_)) {
    graphs_ = std::make_unique<CudaGraphRunner>(*model_, cuda_graph_max_batch,
                                                (max_model_len + block_size - 1) / block_size);
  }
}

ModelRunner::~ModelRunner() = default;

ModelRunnerOutput ModelRunner::execute(const SchedulerOutput& work,
                                       const std::vector<SamplingTarget>& targets) {
  ModelRunnerOutput out;
  std::vector<std::pair<int32_t, int32_t>> copies;
  for (const BlockCopy& c : work.block_copies) copies.emplace_back(c.src, c.dst);
  kv_cache_.copy_blocks(copies);

  for (const SamplingTarget& t : targets) {
    const ScheduledSequence& s = work.scheduled.at(t.scheduled_index);
    if (t.position < 0 || t.position >= s.num_new_tokens) {
      throw std::out_of_range("sampling position " + std::to_string(t.position) +
                              " is outside the step's " + std::to_string(s.num_new_tokens) +
                              " tokens of sequence " + std::to_string(s.seq_id));
    }
  }
  Proposals proposals;
  proposals.tokens.resize(work.scheduled.size());
  if (speculator_) {
    const auto started = std::chrono::steady_clock::now();
    std::vector<const SamplingRow*> rows(work.scheduled.size(), nullptr);
    for (const SamplingTarget& t : targets) {
      const ScheduledSequence& s = work.scheduled[t.scheduled_index];
      if (s.num_speculative_tokens == 0) continue;
      if (rows[t.scheduled_index] || t.position != s.num_new_tokens - 1) {
        throw std::invalid_argument("a sequence with draft slots needs one target at its last "
                                    "new token");
      }
      rows[t.scheduled_index] = &t.row;
    }
    proposals = speculator_->propose({work, scheduler_, rows});
    for (size_t i = 0; i < work.scheduled.size(); ++i) {
      if (static_cast<int64_t>(proposals.tokens[i].size()) >
          work.scheduled[i].num_speculative_tokens) {
        throw std::logic_error("the proposer gave more drafts than the sequence has slots");
      }
    }
    out.propose_seconds = seconds_since(started);
  }
  const bool verifies = proposals.num_tokens() > 0;
  const auto forward_started = std::chrono::steady_clock::now();

  ForwardBatchBuilder builder(kv_cache_.block_size(), model_->lora_enabled());
  const PagedBlockManager& blocks = scheduler_.block_manager();
  std::vector<int64_t> starts;  // first row of each scheduled sequence in the flattened batch
  int64_t num_rows = 0;
  bool decode_only = !verifies;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    const auto& tokens = scheduler_.token_ids(s.seq_id);
    std::vector<int64_t> fed(tokens.begin() + s.num_computed,
                             tokens.begin() + s.num_computed + s.num_new_tokens);
    fed.insert(fed.end(), proposals.tokens[i].begin(), proposals.tokens[i].end());
    if (blocks.num_groups() == 1) {
      builder.add(fed, s.num_computed, blocks.block_table(s.seq_id),
                  scheduler_.lora_slot(s.seq_id));
    } else {
      std::vector<std::vector<int32_t>> tables;
      for (int64_t g = 0; g < blocks.num_groups(); ++g) {
        tables.push_back(blocks.block_table(s.seq_id, g));
      }
      builder.add_grouped(fed, s.num_computed, tables, scheduler_.lora_slot(s.seq_id));
    }
    starts.push_back(num_rows);
    num_rows += static_cast<int64_t>(fed.size());
    decode_only = decode_only && fed.size() == 1;
  }
  at::Tensor hidden;
  const int64_t graph_size = graphs_ && decode_only && builder.max_table_blocks() <=
                                                           graphs_->table_width()
                                 ? graphs_->padded_size(builder.num_sequences())
                                 : 0;
  if (graph_size > 0) {
    while (builder.num_sequences() < graph_size) builder.add_padding();
    hidden = graphs_->forward(builder, kv_cache_.layers());
    out.cuda_graph = true;
  } else {
    const ForwardBatch batch = builder.build(model_->device());
    hidden = model_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
  }
  out.samples.resize(targets.size());
  if (targets.empty()) return out;

  // Rows of `hidden` whose logits are needed: plain targets first, each row once (consecutive
  // targets at one row are the n samples of a prompt), then each verified target's k + 1 rows.
  std::vector<int64_t> hidden_rows, logit_row_of_target;
  std::vector<size_t> plain, verified;
  for (size_t i = 0; i < targets.size(); ++i) {
    const SamplingTarget& t = targets[i];
    if (!proposals.tokens[t.scheduled_index].empty()) {
      verified.push_back(i);
      continue;
    }
    plain.push_back(i);
    const int64_t row = starts[t.scheduled_index] + t.position;
    if (hidden_rows.empty() || hidden_rows.back() != row) hidden_rows.push_back(row);
    logit_row_of_target.push_back(static_cast<int64_t>(hidden_rows.size()) - 1);
  }
  const int64_t num_plain_rows = static_cast<int64_t>(hidden_rows.size());
  for (size_t i : verified) {
    const SamplingTarget& t = targets[i];
    const int64_t k = static_cast<int64_t>(proposals.tokens[t.scheduled_index].size());
    for (int64_t j = 0; j <= k; ++j) hidden_rows.push_back(starts[t.scheduled_index] + t.position + j);
  }
  at::Tensor logits =
      model_->compute_logits(hidden.index_select(0, to_tensor(hidden_rows, hidden.device())));

  if (!plain.empty()) {
    at::Tensor plain_logits = logits.narrow(0, 0, num_plain_rows);
    // A copy of [targets, vocab] only when rows repeat.
    if (logit_row_of_target.size() != static_cast<size_t>(num_plain_rows)) {
      plain_logits = plain_logits.index_select(0, to_tensor(logit_row_of_target, logits.device()));
    }
    std::vector<SamplingRow> rows;
    for (size_t i : plain) rows.push_back(targets[i].row);
    SamplerOutput sampled = sampler_.sample(plain_logits, rows);
    const int64_t* token = sampled.token_ids.data_ptr<int64_t>();
    for (size_t p = 0; p < plain.size(); ++p) {
      out.samples[plain[p]].token_ids = {token[p]};
      out.samples[plain[p]].logprobs = {std::move(sampled.logprobs[p])};
    }
  }
  if (!verified.empty()) {
    at::Tensor verify_logits = logits.narrow(0, num_plain_rows, logits.size(0) - num_plain_rows);
    std::vector<SamplingRow> rows;
    std::vector<std::vector<int64_t>> drafts;
    for (size_t i : verified) {
      rows.push_back(targets[i].row);
      drafts.push_back(proposals.tokens[targets[i].scheduled_index]);
    }
    // The draft distributions are in scheduled order; the targets normally are too.
    at::Tensor draft_probs = proposals.probs;
    if (draft_probs.defined() && !std::is_sorted(verified.begin(), verified.end(), [&](size_t a, size_t b) {
          return targets[a].scheduled_index < targets[b].scheduled_index;
        })) {
      std::vector<int64_t> offset(work.scheduled.size() + 1, 0), order;
      for (size_t i = 0; i < work.scheduled.size(); ++i) {
        offset[i + 1] = offset[i] + static_cast<int64_t>(proposals.tokens[i].size());
      }
      for (size_t i : verified) {
        const int64_t entry = targets[i].scheduled_index;
        for (int64_t r = offset[entry]; r < offset[entry + 1]; ++r) order.push_back(r);
      }
      draft_probs = draft_probs.index_select(0, to_tensor(order, draft_probs.device()));
    }
    std::vector<VerifiedTokens> results =
        speculator_->verify(verify_logits, rows, drafts, draft_probs);
    for (size_t v = 0; v < verified.size(); ++v) {
      SampledTokens& sample = out.samples[verified[v]];
      sample.token_ids = std::move(results[v].token_ids);
      sample.logprobs = std::move(results[v].logprobs);
      sample.num_draft_tokens = static_cast<int64_t>(drafts[v].size());
      sample.num_accepted = results[v].num_accepted;
    }
  }
  if (verifies) out.verify_seconds = seconds_since(forward_started);
  return out;
}

}  // namespace kvserve
