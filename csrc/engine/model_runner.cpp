#include "kvserve/model_runner.h"

#include <ATen/ops/from_blob.h>

#include <stdexcept>
#include <string>

#include "kvserve/forward_batch.h"

namespace kvserve {
namespace {

at::Tensor to_device(std::vector<int64_t>& v, const at::Device& device) {
  return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::kLong).to(device);
}

PagedKVCache make_kv_cache(const CausalLM& model, int64_t num_blocks, int64_t block_size) {
  const ModelConfig& c = model.config();
  return PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                      model.dtype(), model.device());
}

}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<CausalLM> model, int64_t num_blocks, int64_t block_size,
                         const Scheduler& scheduler)
    : model_(std::move(model)),
      kv_cache_(make_kv_cache(*model_, num_blocks, block_size)),
      scheduler_(scheduler) {}

ModelRunnerOutput ModelRunner::execute(const SchedulerOutput& work,
                                       const std::vector<SamplingTarget>& targets) {
  std::vector<std::pair<int32_t, int32_t>> copies;
  for (const BlockCopy& c : work.block_copies) copies.emplace_back(c.src, c.dst);
  kv_cache_.copy_blocks(copies);

  ForwardBatchBuilder builder(kv_cache_.block_size());
  const PagedBlockManager& blocks = scheduler_.block_manager();
  for (const ScheduledSequence& s : work.scheduled) {
    const auto& tokens = scheduler_.token_ids(s.seq_id);
    builder.add(std::vector<int64_t>(tokens.begin() + s.num_computed,
                                     tokens.begin() + s.num_computed + s.num_new_tokens),
                s.num_computed, blocks.block_table(s.seq_id));
  }
  const ForwardBatch batch = builder.build(model_->device());
  const at::Tensor hidden =
      model_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
  ModelRunnerOutput out;
  if (targets.empty()) return out;

  // Rows of `hidden` whose logits are needed, each once; consecutive targets at the same row
  // (the n samples of one prompt) read the same logits.
  std::vector<int64_t> starts(work.scheduled.size(), 0);  // host copy of query_start_loc
  for (size_t i = 1; i < starts.size(); ++i) {
    starts[i] = starts[i - 1] + work.scheduled[i - 1].num_new_tokens;
  }
  std::vector<int64_t> hidden_rows, logit_row_of_target;
  for (const SamplingTarget& t : targets) {
    const ScheduledSequence& s = work.scheduled.at(t.scheduled_index);
    if (t.position < 0 || t.position >= s.num_new_tokens) {
      throw std::out_of_range("sampling position " + std::to_string(t.position) +
                              " is outside the step's " + std::to_string(s.num_new_tokens) +
                              " tokens of sequence " + std::to_string(s.seq_id));
    }
    const int64_t row = starts[t.scheduled_index] + t.position;
    if (hidden_rows.empty() || hidden_rows.back() != row) hidden_rows.push_back(row);
    logit_row_of_target.push_back(static_cast<int64_t>(hidden_rows.size()) - 1);
  }
  at::Tensor logits =
      model_->compute_logits(hidden.index_select(0, to_device(hidden_rows, hidden.device())));
  // A copy of [targets, vocab] only when rows repeat.
  if (logit_row_of_target.size() != hidden_rows.size()) {
    logits = logits.index_select(0, to_device(logit_row_of_target, logits.device()));
  }
  std::vector<SamplingRow> rows;
  rows.reserve(targets.size());
  for (const SamplingTarget& t : targets) rows.push_back(t.row);
  SamplerOutput sampled = sampler_.sample(logits, rows);
  const int64_t* token = sampled.token_ids.data_ptr<int64_t>();
  out.token_ids.assign(token, token + targets.size());
  out.logprobs = std::move(sampled.logprobs);
  return out;
}

}  // namespace kvserve
