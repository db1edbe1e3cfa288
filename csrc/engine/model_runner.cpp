#include "kvserve/model_runner.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"
#include "kvserve/forward_batch.h"
#include "kvserve/tensor_parallel_worker.h"

namespace kvserve {

using engine_helpers::make_kv_cache;
using engine_helpers::to_tensor;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> logits_slices(int64_t num_sampled_rows,
                                                       int64_t num_rows) {
  std::vector<std::pair<int64_t, int64_t>> slices;
  if (num_sampled_rows > 0) slices.emplace_back(0, num_sampled_rows);
  for (int64_t begin = num_sampled_rows; begin < num_rows; begin += kPromptLogitsRowsPerSlice) {
    slices.emplace_back(begin, std::min(kPromptLogitsRowsPerSlice, num_rows - begin));
  }
  return slices;
}

namespace {

// Whether the layers are grouped by sliding window (then the pool's layers are grouped the same
// way).
bool grouped(const std::vector<int64_t>& group_windows) {
  return group_windows.size() > 1 || (!group_windows.empty() && group_windows[0] > 0);
}

}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<CausalLM> model, const SequenceTable& sequences,
                         ModelRunnerOptions options)
    : model_(std::move(model)),
      kv_cache_(make_kv_cache(*model_, options.num_blocks, options.block_size,
                              grouped(options.group_windows), options.kv_cache_dtype,
                              options.num_state_slots, options.ssm_state_dtype)),
      sequences_(sequences),
      speculator_(options.speculator),
      workers_(options.workers && options.workers->size() > 1 ? options.workers : nullptr) {
  if (workers_ && workers_->rank() != 0) {
    throw std::invalid_argument("ModelRunner: the engine runs on rank 0 of its workers' group");
  }
  if (workers_ && (!model_->ranks() || model_->ranks()->size() != workers_->size())) {
    throw std::invalid_argument("ModelRunner: the model is not split over its workers' ranks");
  }
  if (options.group_windows != kv_cache_.layout().group_windows()) {
    throw std::invalid_argument("ModelRunner: the block manager's groups of layers do not match "
                                "the model's sliding windows");
  }
  if (options.cuda_graph_max_batch > 0 && options.max_model_len > 0 && !workers_ &&
      CudaGraphRunner::supports(*model_)) {
    graphs_ = std::make_unique<CudaGraphRunner>(
        *model_, options.cuda_graph_max_batch,
        (options.max_model_len + options.block_size - 1) / options.block_size);
  }
}

ModelRunner::~ModelRunner() {
  if (!workers_) return;
  try {
    send_to_workers(*workers_, WorkerCommand::kStop);
  } catch (const std::exception&) {
    // A worker already gone: nothing left to stop.
  }
}

StepCopies ModelRunner::prepare(
    const SchedulerOutput& work, const std::vector<SamplingTarget>& targets,
    const std::vector<PromptLogprobsTarget>& prompt_targets, const TokenFeed* feed) {
  // Every token still being sampled (kPendingToken) must be one that `feed` fills.
  std::vector<int64_t> pending;
  int64_t row = 0;
  for (const ScheduledSequence& s : work.scheduled) {
    for (const int32_t token : s.token_ids) {
      if (token == kPendingToken) pending.push_back(row);
      ++row;
    }
  }
  if (pending != (feed ? feed->rows : std::vector<int64_t>{})) {
    throw std::logic_error("ModelRunner: the step's tokens still being sampled are not the ones "
                           "its token feed fills");
  }
  StepCopies copies;
  for (const BlockCopy& c : work.block_copies) copies.blocks.emplace_back(c.src, c.dst);
  for (const StateCopy& c : work.state_copies) copies.states.emplace_back(c.src, c.dst);
  for (const StateCopy& c : work.state_snapshots) copies.snapshots.emplace_back(c.src, c.dst);
  kv_cache_.copy_blocks(copies.blocks);
  kv_cache_.copy_states(copies.states);

  const size_t num_groups = kv_cache_.layout().group_windows().size();
  for (const ScheduledSequence& s : work.scheduled) {
    if (static_cast<int64_t>(s.token_ids.size()) != s.num_new_tokens ||
        s.block_tables.size() != num_groups) {
      throw std::invalid_argument("scheduled sequence " + std::to_string(s.seq_id) +
                                  " carries " + std::to_string(s.token_ids.size()) +
                                  " tokens and " + std::to_string(s.block_tables.size()) +
                                  " block tables; the step needs " +
                                  std::to_string(s.num_new_tokens) + " and " +
                                  std::to_string(num_groups));
    }
  }
  for (const SamplingTarget& t : targets) {
    const ScheduledSequence& s = work.scheduled.at(t.scheduled_index);
    if (t.position < 0 || t.position >= s.num_new_tokens) {
      throw std::out_of_range("sampling position " + std::to_string(t.position) +
                              " is outside the step's " + std::to_string(s.num_new_tokens) +
                              " tokens of sequence " + std::to_string(s.seq_id));
    }
  }
  for (const PromptLogprobsTarget& t : prompt_targets) {
    const ScheduledSequence& s = work.scheduled.at(t.scheduled_index);
    if (t.position < 0 || t.token_ids.empty() ||
        t.position + static_cast<int64_t>(t.token_ids.size()) > s.num_new_tokens) {
      throw std::out_of_range("prompt logprobs of " + std::to_string(t.token_ids.size()) +
                              " tokens from position " + std::to_string(t.position) +
                              " are outside the step's " + std::to_string(s.num_new_tokens) +
                              " tokens of sequence " + std::to_string(s.seq_id));
    }
  }
  return copies;
}

std::vector<int64_t> ModelRunner::add_sequences(const SchedulerOutput& work,
                                                const Proposals* proposals,
                                                ForwardBatchBuilder& builder, bool& decode_only) {
  std::vector<int64_t> bounds = {0};
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    std::vector<int64_t> fed(s.token_ids.begin(), s.token_ids.end());
    if (proposals) fed.insert(fed.end(), proposals->tokens[i].begin(), proposals->tokens[i].end());
    if (kv_cache_.layout().has_state() && s.state_slot < 0) {
      throw std::invalid_argument("scheduled sequence " + std::to_string(s.seq_id) +
                                  " has no state slot; the model keeps states");
    }
    builder.add_grouped(fed, s.num_computed, s.block_tables, s.lora_slot, s.state_slot);
    bounds.push_back(bounds.back() + static_cast<int64_t>(fed.size()));
    decode_only = decode_only && fed.size() == 1;
  }
  return bounds;
}

namespace {

// Appends the rows of the step's hidden states that score `prompt_targets`, in their order;
// `starts`: the first row of each scheduled sequence.
void append_prompt_rows(const std::vector<PromptLogprobsTarget>& prompt_targets,
                        const std::vector<int64_t>& starts, std::vector<int64_t>& hidden_rows) {
  for (const PromptLogprobsTarget& t : prompt_targets) {
    for (size_t j = 0; j < t.token_ids.size(); ++j) {
      hidden_rows.push_back(starts[t.scheduled_index] + t.position + static_cast<int64_t>(j));
    }
  }
}

}  // namespace

ModelRunnerOutput ModelRunner::execute(const SchedulerOutput& work,
                                       const std::vector<SamplingTarget>& targets,
                                       const std::vector<PromptLogprobsTarget>& prompt_targets) {
  ModelRunnerOutput out;
  StepCopies copies = prepare(work, targets, prompt_targets, nullptr);
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
    proposals = speculator_->propose({work, sequences_, rows});
    for (size_t i = 0; i < work.scheduled.size(); ++i) {
      if (static_cast<int64_t>(proposals.tokens[i].size()) >
          work.scheduled[i].num_speculative_tokens) {
        throw std::logic_error("the proposer gave more drafts than the sequence has slots");
      }
    }
    out.propose_seconds = seconds_since(started);
  }
  const bool verifies = proposals.num_tokens() > 0;
  // A state that verifies drafts is backed up first (only where some were proposed), for when
  // one is rejected (Scheduler::settle_speculative_state); the workers do it with the step.
  std::vector<std::pair<int32_t, int32_t>> backups;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    if (s.state_backup_slot >= 0 && !proposals.tokens[i].empty()) {
      backups.emplace_back(s.state_slot, s.state_backup_slot);
    }
  }
  kv_cache_.copy_states(backups);
  copies.states.insert(copies.states.end(), backups.begin(), backups.end());
  const auto forward_started = std::chrono::steady_clock::now();

  ForwardBatchBuilder builder(kv_cache_.block_size(), model_->lora_enabled());
  bool decode_only = !verifies && prompt_targets.empty();
  const std::vector<int64_t> starts = add_sequences(work, &proposals, builder, decode_only);
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
  const int64_t num_sampled_rows = static_cast<int64_t>(hidden_rows.size());
  for (const PromptLogprobsTarget& t : prompt_targets) {
    if (!proposals.tokens[t.scheduled_index].empty()) {
      throw std::invalid_argument("prompt logprobs of a sequence that has drafts");
    }
  }
  append_prompt_rows(prompt_targets, starts, hidden_rows);
  const at::Tensor hidden = run_forward(builder, decode_only, copies, hidden_rows,
                                        num_sampled_rows, nullptr, out.cuda_graph);
  kv_cache_.copy_states(copies.snapshots);  // saved now that the forward has written them
  if (speculator_) {  // a proposer that drafts from the target's hidden states keeps them
    speculator_->observe(work, starts, hidden);
  }
  out.samples.resize(targets.size());
  if (hidden_rows.empty()) return out;
  const at::Tensor rows_index = to_tensor(hidden_rows, hidden.device());
  const auto slices = logits_slices(num_sampled_rows, static_cast<int64_t>(hidden_rows.size()));
  size_t next_slice = 0;
  if (num_sampled_rows > 0) {
    const auto [begin, count] = slices[next_slice++];
    const at::Tensor rows = rows_index.narrow(0, begin, count);
    sample_targets(model_->compute_logits(hidden.index_select(0, rows)), targets, plain, verified,
                   logit_row_of_target, num_plain_rows, proposals, work, out);
  }
  if (prompt_targets.empty()) {
    if (verifies) out.verify_seconds = seconds_since(forward_started);
    return out;
  }
  out.prompt_logprobs =
      score_prompt(hidden, rows_index, slices, next_slice, num_sampled_rows, prompt_targets);
  if (verifies) out.verify_seconds = seconds_since(forward_started);
  return out;
}

std::vector<std::vector<TokenLogprobs>> ModelRunner::score_prompt(
    const at::Tensor& hidden, const at::Tensor& rows_index,
    const std::vector<std::pair<int64_t, int64_t>>& slices, size_t first_slice,
    int64_t num_sampled_rows, const std::vector<PromptLogprobsTarget>& prompt_targets) {
  std::vector<std::vector<TokenLogprobs>> scored_rows(prompt_targets.size());
  if (prompt_targets.empty()) return scored_rows;
  // Each prompt row's target and the token it scores, in the order of the rows.
  std::vector<SamplingParams> prompt_params(prompt_targets.size());
  std::vector<SamplingRow> prompt_rows;
  std::vector<int64_t> scored, target_of_row;
  for (size_t k = 0; k < prompt_targets.size(); ++k) {
    prompt_params[k].logprobs = prompt_targets[k].num_top;
    for (const int64_t token : prompt_targets[k].token_ids) {
      prompt_rows.push_back(SamplingRow{&prompt_params[k]});
      scored.push_back(token);
      target_of_row.push_back(static_cast<int64_t>(k));
    }
  }
  for (size_t slice = first_slice; slice < slices.size(); ++slice) {
    const auto [begin, count] = slices[slice];
    const at::Tensor logits =
        model_->compute_logits(hidden.index_select(0, rows_index.narrow(0, begin, count)));
    const int64_t first = begin - num_sampled_rows;
    const std::vector<SamplingRow> rows(prompt_rows.begin() + first,
                                        prompt_rows.begin() + first + count);
    PendingLogprobs pending = sampler_.begin_logprobs(logits, rows);
    const at::Tensor tokens =
        to_tensor(std::vector<int64_t>(scored.begin() + first, scored.begin() + first + count),
                  logits.device());
    std::vector<std::optional<TokenLogprobs>> entries =
        sampler_.finish_logprobs(pending, tokens, rows);
    for (int64_t r = 0; r < count; ++r) {
      scored_rows[target_of_row[first + r]].push_back(std::move(*entries[r]));
    }
  }
  return scored_rows;
}

at::Tensor ModelRunner::run_forward(ForwardBatchBuilder& builder, bool decode_only,
                                    const StepCopies& copies,
                                    const std::vector<int64_t>& hidden_rows,
                                    int64_t num_sampled_rows, const TokenFeed* feed,
                                    bool& cuda_graph) {
  const int64_t graph_size =
      graphs_ && decode_only && builder.max_table_blocks() <= graphs_->table_width()
          ? graphs_->padded_size(builder.num_sequences())
          : 0;
  if (graph_size > 0) {
    while (builder.num_sequences() < graph_size) builder.add_padding();
    cuda_graph = true;
    return graphs_->forward(builder, kv_cache_.layers(), feed);
  }
  if (workers_) {
    send_to_workers(*workers_, WorkerCommand::kStep,
                    pack_step(copies, hidden_rows, num_sampled_rows, builder, feed));
    if (feed) send_fed_tokens(*model_->ranks(), *feed);
  }
  ForwardBatch batch = builder.build(model_->device());
  if (feed) feed->apply(batch.input_ids);
  return model_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
}

LaunchedStep ModelRunner::launch(const SchedulerOutput& work,
                                 const std::vector<SamplingTarget>& targets,
                                 const std::vector<PromptLogprobsTarget>& prompt_targets,
                                 const TokenFeed& feed) {
  if (speculator_) {
    throw std::logic_error("ModelRunner::launch: no asynchronous steps with speculation");
  }
  const StepCopies copies = prepare(work, targets, prompt_targets, &feed);
  ForwardBatchBuilder builder(kv_cache_.block_size(), model_->lora_enabled());
  bool decode_only = prompt_targets.empty();
  const std::vector<int64_t> starts = add_sequences(work, nullptr, builder, decode_only);
  // Rows of `hidden` whose logits are needed: one per target, then the prompt rows scored.
  std::vector<int64_t> hidden_rows;
  std::vector<SamplingRow> rows;
  for (const SamplingTarget& t : targets) {
    hidden_rows.push_back(starts[t.scheduled_index] + t.position);
    rows.push_back(t.row);
  }
  const int64_t num_sampled_rows = static_cast<int64_t>(hidden_rows.size());
  append_prompt_rows(prompt_targets, starts, hidden_rows);
  LaunchedStep step;
  const at::Tensor hidden = run_forward(builder, decode_only, copies, hidden_rows,
                                        num_sampled_rows, &feed, step.cuda_graph);
  kv_cache_.copy_states(copies.snapshots);  // saved now that the forward has written them
  if (hidden_rows.empty()) return step;
  const at::Tensor rows_index = to_tensor(hidden_rows, hidden.device());
  const auto slices = logits_slices(num_sampled_rows, static_cast<int64_t>(hidden_rows.size()));
  size_t next_slice = 0;
  if (num_sampled_rows > 0) {
    const auto [begin, count] = slices[next_slice++];
    at::Tensor logits =
        model_->compute_logits(hidden.index_select(0, rows_index.narrow(0, begin, count)));
    step.samples = sampler_.begin_sample(logits, rows, feed.tokens);
  }
  // Scored now: the host waits for the forward in a step that scores prompt tokens.
  step.prompt_logprobs =
      score_prompt(hidden, rows_index, slices, next_slice, num_sampled_rows, prompt_targets);
  return step;
}

ModelRunnerOutput ModelRunner::finish(LaunchedStep& step) {
  ModelRunnerOutput out;
  out.cuda_graph = step.cuda_graph;
  if (step.samples.num_rows == 0) return out;
  SamplerOutput sampled = sampler_.finish_sample(step.samples);
  out.samples.resize(step.samples.num_rows);
  const int64_t* token = sampled.token_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < step.samples.num_rows; ++i) {
    out.samples[i].token_ids = {token[i]};
    out.samples[i].logprobs = {std::move(sampled.logprobs[i])};
  }
  return out;
}

void ModelRunner::sample_targets(at::Tensor logits, const std::vector<SamplingTarget>& targets,
                                 const std::vector<size_t>& plain,
                                 const std::vector<size_t>& verified,
                                 const std::vector<int64_t>& logit_row_of_target,
                                 int64_t num_plain_rows, const Proposals& proposals,
                                 const SchedulerOutput& work, ModelRunnerOutput& out) {

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
}

}  // namespace kvserve
