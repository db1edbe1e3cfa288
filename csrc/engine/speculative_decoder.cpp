// SpeculativeDecoder: the proposer's factory, the batch-size rule, and verification by exact
// rejection sampling on the target's processed distributions.
#include "kvserve/speculative_decoder.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <deque>
#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"
#include "kernels/sampling/rejection_sampling.h"
#include "kvserve/causal_lm.h"
#include "kvserve/draft_model_proposer.h"
#include "kvserve/head_proposer.h"
#include "kvserve/ngram_proposer.h"
#include "models/eagle3_head.h"
#include "models/mtp_head.h"

namespace kvserve {

using engine_helpers::to_tensor;

namespace {

// Drafts per sequence and step at most: a step verifies k + 1 positions per sequence.
constexpr int64_t kMaxSpeculativeTokens = 64;

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("speculative decoding: " + message);
}

}  // namespace

void SpeculativeConfig::validate() const {
  const std::vector<std::string> methods = speculative_methods();
  if (!method.empty() && std::find(methods.begin(), methods.end(), method) == methods.end()) {
    std::string list;
    for (const std::string& m : methods) list += (list.empty() ? "\"" : ", \"") + m + "\"";
    require(false, "speculative_method must be one of " + list + ", got \"" + method + "\"");
  }
  if (!enabled()) return;
  require(num_speculative_tokens >= 1 && num_speculative_tokens <= kMaxSpeculativeTokens,
          "num_speculative_tokens must be in [1, " + std::to_string(kMaxSpeculativeTokens) +
              "], got " + std::to_string(num_speculative_tokens));
  require(prompt_lookup_min >= 1 && prompt_lookup_max >= prompt_lookup_min,
          "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got " +
              std::to_string(prompt_lookup_min) + " and " + std::to_string(prompt_lookup_max));
  require(disable_batch_size >= 0,
          "speculative_disable_batch_size must be >= 0, got " +
              std::to_string(disable_batch_size));
  require(max_verify_tokens >= 0,
          "speculative_max_verify_tokens must be >= 0, got " +
              std::to_string(max_verify_tokens));
}

int64_t Proposals::num_tokens() const {
  int64_t n = 0;
  for (const auto& t : tokens) n += static_cast<int64_t>(t.size());
  return n;
}

SamplingRow row_after_drafts(const SamplingRow& row, const std::vector<int64_t>& drafts,
                             size_t num_drafts, std::vector<int64_t>& storage) {
  if (num_drafts == 0 || !row.params->needs_token_history()) return row;
  storage = *row.output_token_ids;
  storage.insert(storage.end(), drafts.begin(), drafts.begin() + num_drafts);
  SamplingRow extended = row;
  extended.output_token_ids = &storage;
  return extended;
}

SpeculativeDecoder::SpeculativeDecoder(SpeculativeConfig config, std::unique_ptr<Proposer> proposer)
    : config_(std::move(config)), proposer_(std::move(proposer)) {
  config_.validate();
  require(config_.enabled() && proposer_ != nullptr, "a method and a proposer are required");
}

const std::vector<ProposerEntry>& proposer_registry() {
  static const std::vector<ProposerEntry> entries = {
      {"ngram", false,
       [](const ProposerContext& c) -> std::unique_ptr<Proposer> {
         return std::make_unique<NgramProposer>(c.config.prompt_lookup_min,
                                                c.config.prompt_lookup_max);
       }},
      {"draft_model", true,
       [](const ProposerContext& c) -> std::unique_ptr<Proposer> {
         const ModelConfig& t = c.target.config();
         const ModelConfig& d = c.draft->config();
         require(d.vocab_size == t.vocab_size,
                 "the draft model's vocabulary (" + std::to_string(d.vocab_size) +
                     " tokens) differs from the target's (" + std::to_string(t.vocab_size) + ")");
         require(d.max_position_embeddings >= c.max_model_len,
                 "the draft model handles " + std::to_string(d.max_position_embeddings) +
                     " positions, fewer than max_model_len " + std::to_string(c.max_model_len));
         require(c.draft->device() == c.target.device(), "the draft model is on another device");
         return std::make_unique<DraftModelProposer>(c.draft, c.num_blocks, c.block_size);
       }},
      {"mtp", true,
       [](const ProposerContext& c) -> std::unique_ptr<Proposer> {
         auto head = std::dynamic_pointer_cast<MtpHead>(c.draft);
         require(head != nullptr,
                 "method \"mtp\" drafts with the target checkpoint's multi-token-prediction "
                 "modules (an MtpHead), not with a draft model");
         require(head->device() == c.target.device(), "the MTP modules are on another device");
         return std::make_unique<HeadProposer>(std::move(head), c.num_blocks, c.block_size,
                                               c.workers);
       }},
      {"eagle3", true,
       [](const ProposerContext& c) -> std::unique_ptr<Proposer> {
         auto head = std::dynamic_pointer_cast<Eagle3Head>(c.draft);
         require(head != nullptr,
                 "method \"eagle3\" drafts with an EAGLE-3 head (an Eagle3Head), not with a "
                 "draft model");
         require(head->device() == c.target.device(), "the EAGLE-3 head is on another device");
         require(head->config().max_position_embeddings >= c.max_model_len,
                 "the EAGLE-3 head handles " +
                     std::to_string(head->config().max_position_embeddings) +
                     " positions, fewer than max_model_len " + std::to_string(c.max_model_len));
         return std::make_unique<HeadProposer>(std::move(head), c.num_blocks, c.block_size);
       }},
  };
  return entries;
}

std::vector<std::string> speculative_methods() {
  std::vector<std::string> names;
  for (const ProposerEntry& e : proposer_registry()) names.push_back(e.method);
  return names;
}

std::unique_ptr<SpeculativeDecoder> SpeculativeDecoder::create(
    const SpeculativeConfig& config, const CausalLM& target, std::shared_ptr<CausalLM> draft,
    int64_t num_blocks, int64_t block_size, int64_t max_model_len,
    std::shared_ptr<Communicator> workers) {
  config.validate();
  if (!config.enabled()) {
    require(draft == nullptr, "a draft model was given but method is off");
    return nullptr;
  }
  for (const ProposerEntry& entry : proposer_registry()) {
    if (entry.method != config.method) continue;
    require(entry.needs_draft_model == (draft != nullptr),
            "method \"" + entry.method + (entry.needs_draft_model ? "\" needs a draft model"
                                                                  : "\" takes no draft model"));
    const ProposerContext context{config,     target,        std::move(draft),  num_blocks,
                                  block_size, max_model_len, std::move(workers)};
    return std::make_unique<SpeculativeDecoder>(config, entry.make(context));
  }
  throw std::logic_error("validate() let through speculative method " + config.method);
}

int64_t SpeculativeDecoder::num_speculative_tokens(int64_t num_running) const {
  if (config_.disable_batch_size > 0 && num_running >= config_.disable_batch_size) return 0;
  int64_t k = config_.num_speculative_tokens;
  if (config_.max_verify_tokens > 0) {
    k = std::min(k, config_.max_verify_tokens / std::max<int64_t>(num_running, 1) - 1);
  }
  return std::max<int64_t>(k, 0);
}

std::vector<VerifiedTokens> SpeculativeDecoder::verify(
    at::Tensor& logits, const std::vector<SamplingRow>& rows,
    const std::vector<std::vector<int64_t>>& drafts, const at::Tensor& draft_probs) const {
  TORCH_CHECK(rows.size() == drafts.size(), "verify: one row and one draft list per sequence");
  const int64_t batch = static_cast<int64_t>(rows.size());
  std::vector<int64_t> cu(batch + 1, 0), draft_ids;
  for (int64_t b = 0; b < batch; ++b) {
    cu[b + 1] = cu[b] + static_cast<int64_t>(drafts[b].size());
    draft_ids.insert(draft_ids.end(), drafts[b].begin(), drafts[b].end());
  }
  const int64_t num_rows = cu[batch] + batch;
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == num_rows, "verify: logits need ", num_rows,
              " rows (drafts + one per sequence), got ", logits.sizes());
  // Position j of sequence b sees drafts [0, j) as generated tokens.
  std::deque<std::vector<int64_t>> histories;
  std::vector<SamplingRow> position_rows;
  position_rows.reserve(num_rows);
  for (int64_t b = 0; b < batch; ++b) {
    for (size_t j = 0; j <= drafts[b].size(); ++j) {
      position_rows.push_back(row_after_drafts(rows[b], drafts[b], j, histories.emplace_back()));
    }
  }
  PendingLogprobs pending = sampler_.begin_logprobs(logits, position_rows);
  const at::Tensor target_probs = sampler_.probabilities(logits, position_rows);
  std::vector<float> uniform(num_rows, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    if (rows[b].params->temperature < SamplingParams::kGreedyTemperature) continue;
    for (int64_t r = cu[b] + b; r <= cu[b + 1] + b; ++r) uniform[r] = rows[b].random->next_uniform();
  }
  const at::Device device = logits.device();
  const at::Tensor no_drafts = at::empty({0, logits.size(1)}, logits.options());
  auto [tokens, accepted] = ops::rejection_sample(
      target_probs, draft_probs.defined() ? draft_probs : no_drafts,
      to_tensor(draft_ids, device), to_tensor(cu, device),
      to_tensor(uniform, device));
  tokens = tokens.cpu().contiguous();
  accepted = accepted.cpu().contiguous();
  const int64_t width = tokens.size(1);
  const int64_t* token = tokens.data_ptr<int64_t>();
  // The token each position row emitted (-1: none), for its logprobs.
  std::vector<int64_t> emitted(num_rows, -1);
  std::vector<VerifiedTokens> out(batch);
  for (int64_t b = 0; b < batch; ++b) {
    VerifiedTokens& v = out[b];
    v.num_accepted = accepted.data_ptr<int64_t>()[b];
    v.token_ids.assign(token + b * width, token + b * width + v.num_accepted + 1);
    for (int64_t j = 0; j <= v.num_accepted; ++j) emitted[cu[b] + b + j] = v.token_ids[j];
  }
  const at::Tensor emitted_t = at::from_blob(emitted.data(), {num_rows}, at::kLong);
  const auto logprobs = sampler_.finish_logprobs(pending, emitted_t.to(device), position_rows);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j <= out[b].num_accepted; ++j) {
      out[b].logprobs.push_back(logprobs[cu[b] + b + j]);
    }
  }
  return out;
}

}  // namespace kvserve
