#include "kvserve/sampler.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <limits>
#include <stdexcept>
#include <tuple>

#include "engine/engine_helpers.h"
#include "kernels/sampling/sampling.h"

namespace kvserve {

using engine_helpers::to_tensor;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Logits of many (row, token) cells read, changed and written back in one gather and one scatter,
// so the cost follows the number of distinct history tokens, never the vocabulary.
struct CellUpdates {
  std::vector<int64_t> row, token;
  std::vector<float> divide_positive;  // repetition penalty (1: none)
  std::vector<float> subtract;         // presence * (count > 0) + frequency * count
  // What `subtract` is made of, for a history whose last token is still on the device.
  std::vector<int64_t> count;
  std::vector<double> presence, frequency;

  size_t size() const { return row.size(); }
};

void check_history_id(int64_t id, int64_t vocab, size_t row) {
  TORCH_CHECK(id >= 0 && id < vocab, "Sampler: row ", row, " has token id ", id,
              " in its history, outside the vocabulary [0, ", vocab, ")");
}

// Appends one cell per distinct token of the row's prompt and output that a penalty changes.
// slot: vocab-sized scratch, all -1 on entry and on return.
void add_penalty_cells(int64_t r, const SamplingRow& row, int64_t vocab,
                       std::vector<int64_t>& slot, CellUpdates& cells) {
  const SamplingParams& p = *row.params;
  const size_t first = cells.size();
  std::vector<int64_t> counts;
  std::vector<bool> repeated;
  auto cell = [&](int64_t id) {
    check_history_id(id, vocab, r);
    if (slot[id] < 0) {
      slot[id] = static_cast<int64_t>(counts.size());
      counts.push_back(0);
      repeated.push_back(false);
      cells.row.push_back(r);
      cells.token.push_back(id);
    }
    return slot[id];
  };
  if (p.repetition_penalty != 1.0) {
    for (int64_t id : *row.prompt_token_ids) repeated[cell(id)] = true;
    for (int64_t id : *row.output_token_ids) repeated[cell(id)] = true;
  }
  if (p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) {
    for (int64_t id : *row.output_token_ids) ++counts[cell(id)];
  }
  for (size_t k = 0; k < counts.size(); ++k) {
    cells.divide_positive.push_back(repeated[k] ? static_cast<float>(p.repetition_penalty) : 1.0f);
    cells.subtract.push_back(static_cast<float>(
        p.presence_penalty * (counts[k] > 0) + p.frequency_penalty * counts[k]));
    cells.count.push_back(counts[k]);
    cells.presence.push_back(p.presence_penalty);
    cells.frequency.push_back(p.frequency_penalty);
    slot[cells.token[first + k]] = -1;
  }
}

// Logits x with their penalties: Hugging Face's and vLLM's repetition penalty (a positive logit
// divided by it, a negative one multiplied), then `subtract` (presence and frequency) taken off.
at::Tensor penalize(const at::Tensor& x, const at::Tensor& divide, const at::Tensor& subtract) {
  return at::where(x.gt(0), x.div(divide), x.mul(divide)).sub(subtract);
}

void apply_cells(at::Tensor& logits, CellUpdates& cells) {
  if (cells.size() == 0) return;
  const at::Device device = logits.device();
  const c10::List<std::optional<at::Tensor>> index{to_tensor(cells.row, device),
                                                   to_tensor(cells.token, device)};
  logits.index_put_(index, penalize(logits.index(index), to_tensor(cells.divide_positive, device),
                                    to_tensor(cells.subtract, device)));
}

// presence * (count > 0) + frequency * count, in double as on the host, then float.
at::Tensor penalty_subtract(const at::Tensor& presence, const at::Tensor& frequency,
                            const at::Tensor& count) {
  const at::Tensor n = count.to(at::kDouble);
  return presence.mul(count.gt(0).to(at::kDouble)).add(frequency.mul(n)).to(at::kFloat);
}

// The penalties of rows whose history ends with a token still on the device (`pending_row`:
// per row, its entry of `pending` or -1), exactly as if the token were among `cells`: a cell of
// the same token counts it once more; a row whose token has no cell gets one, with the count 1.
void apply_cells_with_pending(at::Tensor& logits, const CellUpdates& cells,
                              const std::vector<SamplingRow>& rows,
                              const std::vector<int64_t>& pending_row, const at::Tensor& pending) {
  const at::Device device = logits.device();
  // Rows with a penalty and a pending token: their pending token, and their penalties.
  std::vector<int64_t> prow, psource, pindex_of_row(rows.size(), -1);
  std::vector<float> prep;
  std::vector<double> ppresence, pfrequency;
  for (size_t r = 0; r < rows.size(); ++r) {
    const SamplingParams& p = *rows[r].params;
    if (pending_row[r] < 0 || (p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 &&
                               p.frequency_penalty == 0.0)) {
      continue;
    }
    pindex_of_row[r] = static_cast<int64_t>(prow.size());
    prow.push_back(static_cast<int64_t>(r));
    psource.push_back(pending_row[r]);
    prep.push_back(static_cast<float>(p.repetition_penalty));
    ppresence.push_back(p.presence_penalty);
    pfrequency.push_back(p.frequency_penalty);
  }
  if (prow.empty()) {  // no penalized row waits for its token
    CellUpdates copy = cells;
    apply_cells(logits, copy);
    return;
  }
  const at::Tensor tokens = pending.index_select(0, to_tensor(psource, device)).clamp_min(0);
  at::Tensor matched = at::zeros({static_cast<int64_t>(prow.size())},
                                 at::TensorOptions().dtype(at::kLong).device(device));
  if (cells.size() > 0) {
    std::vector<int64_t> cell_pending(cells.size());
    for (size_t k = 0; k < cells.size(); ++k) cell_pending[k] = pindex_of_row[cells.row[k]];
    const at::Tensor which = to_tensor(cell_pending, device);
    const at::Tensor cell_tokens = to_tensor(cells.token, device);
    const at::Tensor match =
        which.ge(0).logical_and(tokens.index_select(0, which.clamp_min(0)).eq(cell_tokens));
    const at::Tensor count = to_tensor(cells.count, device).add(match.to(at::kLong));
    const c10::List<std::optional<at::Tensor>> index{to_tensor(cells.row, device), cell_tokens};
    logits.index_put_(index, penalize(logits.index(index),
                                      to_tensor(cells.divide_positive, device),
                                      penalty_subtract(to_tensor(cells.presence, device),
                                                       to_tensor(cells.frequency, device), count)));
    matched.index_add_(0, which.clamp_min(0), match.logical_and(which.ge(0)).to(at::kLong));
  }
  // The pending tokens without a cell, each a cell of count 1 (one per row: no write collides).
  const c10::List<std::optional<at::Tensor>> index{to_tensor(prow, device), tokens};
  const at::Tensor x = logits.index(index);
  const at::Tensor fresh =
      penalize(x, to_tensor(prep, device),
               penalty_subtract(to_tensor(ppresence, device), to_tensor(pfrequency, device),
                                at::ones_like(matched)));
  logits.index_put_(index, at::where(matched.gt(0), x, fresh));
}

// Sets the logits at (rows[i], tokens[i]) to -inf.
void mask_cells(at::Tensor& logits, const std::vector<int64_t>& rows,
                const std::vector<int64_t>& tokens) {
  if (rows.empty()) return;
  const at::Device device = logits.device();
  const c10::List<std::optional<at::Tensor>> index{to_tensor(rows, device),
                                                   to_tensor(tokens, device)};
  logits.index_put_(index, at::scalar_tensor(kNegInf, logits.options()));
}

// While fewer than min_tokens tokens were generated, EOS (unless ignore_eos) and the stop token
// ids are masked to -inf. Ids outside the vocabulary can never be sampled and are skipped.
void mask_until_min_tokens(at::Tensor& logits, const std::vector<SamplingRow>& rows) {
  const int64_t vocab = logits.size(1);
  std::vector<int64_t> mask_row, mask_token;
  auto mask = [&](int64_t r, int64_t id) {
    if (id >= 0 && id < vocab) {
      mask_row.push_back(r);
      mask_token.push_back(id);
    }
  };
  for (size_t r = 0; r < rows.size(); ++r) {
    const SamplingParams& p = *rows[r].params;
    if (p.min_tokens == 0) continue;  // (no history needed: the row may have none)
    const int64_t generated = static_cast<int64_t>(rows[r].output_token_ids->size()) +
                              (rows[r].pending_source >= 0 ? 1 : 0);
    if (generated >= p.min_tokens) {
      continue;
    }
    for (int64_t id : p.stop_token_ids) mask(r, id);
    if (!p.ignore_eos && rows[r].eos_token_ids) {
      for (int64_t id : *rows[r].eos_token_ids) mask(r, id);
    }
  }
  mask_cells(logits, mask_row, mask_token);
}

// Masks to -inf the last token of every bad word whose other tokens end the row's output so far
// (a one-token word everywhere): the output can never complete one. Costs the words' length,
// never the vocabulary.
void mask_bad_words(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                    const at::Tensor& pending) {
  const int64_t vocab = logits.size(1);
  std::vector<int64_t> mask_row, mask_token;
  // Words whose next-to-last token is a row's pending token (still on the device): each
  // (row, token) cell once, masked where any of its words' pending token matches.
  std::map<std::pair<int64_t, int64_t>, int64_t> cell_of;
  std::vector<int64_t> cell_row, cell_token, cell, source, required;
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto& words = rows[r].params->bad_words_token_ids;
    if (words.empty()) continue;
    const std::vector<int64_t>& out = *rows[r].output_token_ids;  // checked by apply_history
    const bool pends = rows[r].pending_source >= 0;
    for (const std::vector<int64_t>& word : words) {
      // The word's tokens before its last must end the output (the pending token last).
      const size_t before = word.size() - 1;
      const size_t known = pends && before > 0 ? before - 1 : before;
      if (known > out.size() ||
          !std::equal(word.begin(), word.begin() + known, out.end() - known)) {
        continue;
      }
      TORCH_CHECK(word.back() >= 0 && word.back() < vocab, "Sampler: row ", r,
                  " has a bad word token id ", word.back(), " outside the vocabulary [0, ",
                  vocab, ")");
      if (known == before) {
        mask_row.push_back(static_cast<int64_t>(r));
        mask_token.push_back(word.back());
        continue;
      }
      const auto key = std::make_pair(static_cast<int64_t>(r), word.back());
      const auto [it, added] = cell_of.emplace(key, static_cast<int64_t>(cell_row.size()));
      if (added) {
        cell_row.push_back(key.first);
        cell_token.push_back(key.second);
      }
      cell.push_back(it->second);
      source.push_back(rows[r].pending_source);
      required.push_back(word[before - 1]);
    }
  }
  mask_cells(logits, mask_row, mask_token);
  if (cell.empty()) return;
  const at::Device device = logits.device();
  const at::Tensor hit = pending.index_select(0, to_tensor(source, device))
                             .eq(to_tensor(required, device))
                             .to(at::kLong);
  const at::Tensor hits = at::zeros({static_cast<int64_t>(cell_row.size())}, hit.options())
                              .index_add_(0, to_tensor(cell, device), hit);
  const c10::List<std::optional<at::Tensor>> index{to_tensor(cell_row, device),
                                                   to_tensor(cell_token, device)};
  const at::Tensor x = logits.index(index);
  logits.index_put_(index, at::where(hits.gt(0), at::full_like(x, kNegInf), x));
}

// Masks to -inf every logit of a row with allowed_token_ids but those ids' (kept values gathered,
// the rows filled, the kept values scattered back).
void keep_allowed_tokens(at::Tensor& logits, const std::vector<SamplingRow>& rows) {
  const int64_t vocab = logits.size(1);
  std::vector<int64_t> masked_rows, keep_row, keep_token;
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto& allowed = rows[r].params->allowed_token_ids;
    if (!allowed) continue;
    masked_rows.push_back(static_cast<int64_t>(r));
    for (int64_t id : *allowed) {
      TORCH_CHECK(id >= 0 && id < vocab, "Sampler: row ", r, " allows token id ", id,
                  " outside the vocabulary [0, ", vocab, ")");
      keep_row.push_back(static_cast<int64_t>(r));
      keep_token.push_back(id);
    }
  }
  if (masked_rows.empty()) return;
  const at::Device device = logits.device();
  const c10::List<std::optional<at::Tensor>> index{to_tensor(keep_row, device),
                                                   to_tensor(keep_token, device)};
  const at::Tensor kept = logits.index(index);
  logits.index_fill_(0, to_tensor(masked_rows, device), kNegInf);
  logits.index_put_(index, kept);
}

// Adds each row's logit_bias to its logits (ids outside the vocabulary: an error; the engine
// refuses them when the request arrives).
void add_logit_bias(at::Tensor& logits, const std::vector<SamplingRow>& rows) {
  const int64_t vocab = logits.size(1);
  std::vector<int64_t> bias_row, bias_token;
  std::vector<float> bias;
  for (size_t r = 0; r < rows.size(); ++r) {
    for (const auto& [id, value] : rows[r].params->logit_bias) {
      TORCH_CHECK(id >= 0 && id < vocab, "Sampler: row ", r, " has logit_bias token id ", id,
                  " outside the vocabulary [0, ", vocab, ")");
      bias_row.push_back(static_cast<int64_t>(r));
      bias_token.push_back(id);
      bias.push_back(static_cast<float>(value));
    }
  }
  if (bias_row.empty()) return;
  const at::Device device = logits.device();
  const c10::List<std::optional<at::Tensor>> index{to_tensor(bias_row, device),
                                                   to_tensor(bias_token, device)};
  logits.index_put_(index, to_tensor(bias, device), /*accumulate=*/true);
}

// Applies allowed_token_ids, bad words, min_tokens, then logit_bias, then the repetition penalty,
// then presence/frequency, in place (vLLM's order).
void apply_history(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                   const at::Tensor& pending = {}) {
  const int64_t vocab = logits.size(1);
  std::vector<int64_t> slot;
  CellUpdates cells;
  std::vector<int64_t> pending_row(rows.size(), -1);
  bool any_pending = false;
  for (size_t r = 0; r < rows.size(); ++r) {
    const SamplingParams& p = *rows[r].params;
    if (rows[r].pending_source >= 0) {
      TORCH_CHECK_VALUE(pending.defined() && rows[r].pending_source < pending.numel(),
                        "Sampler: row ", r, " has pending token ", rows[r].pending_source,
                        " outside the pending tokens");
      pending_row[r] = rows[r].pending_source;
      any_pending = any_pending || p.needs_token_history();
    }
    if (!p.needs_token_history()) continue;
    TORCH_CHECK(rows[r].prompt_token_ids && rows[r].output_token_ids, "Sampler: row ", r,
                " uses penalties, min_tokens or bad words but has no prompt/output token ids");
    if (p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) {
      if (slot.empty()) slot.assign(vocab, -1);
      add_penalty_cells(static_cast<int64_t>(r), rows[r], vocab, slot, cells);
    }
  }
  keep_allowed_tokens(logits, rows);
  mask_bad_words(logits, rows, pending);
  mask_until_min_tokens(logits, rows);  // -inf stays -inf through the bias and penalties below
  add_logit_bias(logits, rows);
  if (any_pending) {
    apply_cells_with_pending(logits, cells, rows, pending_row, pending);
  } else {
    apply_cells(logits, cells);
  }
}

PendingLogprobs raw_logprobs(const at::Tensor& logits, const std::vector<SamplingRow>& rows) {
  PendingLogprobs pending;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (!rows[r].params->logprobs) continue;
    pending.rows.push_back(static_cast<int64_t>(r));
    pending.num_top.push_back(std::min(*rows[r].params->logprobs, logits.size(1)));
  }
  if (pending.rows.empty()) return pending;
  const int64_t max_top = *std::max_element(pending.num_top.begin(), pending.num_top.end());
  const at::Tensor selected = logits.index_select(0, to_tensor(pending.rows, logits.device()));
  pending.logprobs = at::log_softmax(selected, 1, at::kFloat);
  std::tie(pending.top_values, pending.top_ids) = at::topk(pending.logprobs, max_top, 1);
  return pending;
}

// The sampled tokens' logprobs and ranks beside the top entries, on the logits' device:
// {ids, logprob, rank, top values, top ids}.
std::array<at::Tensor, 5> gather_logprobs(const PendingLogprobs& pending,
                                          const at::Tensor& tokens) {
  const at::Tensor index = to_tensor(pending.rows, tokens.device());
  const at::Tensor drawn = tokens.index_select(0, index);
  // A row that had nothing to sample (token -1) gathers at 0; its entry is dropped below.
  const at::Tensor sampled = drawn.clamp_min(0).unsqueeze(1);
  const at::Tensor sampled_logprob = pending.logprobs.gather(1, sampled);
  // vLLM's rank: how many tokens are at least as likely as the sampled one.
  const at::Tensor rank = pending.logprobs.ge(sampled_logprob).sum(1);
  return {drawn, sampled_logprob, rank, pending.top_values, pending.top_ids};
}

// The entries from gather_logprobs' tensors on the host (contiguous).
std::vector<std::optional<TokenLogprobs>> read_logprobs(const std::vector<int64_t>& logprob_rows,
                                                        const std::vector<int64_t>& num_top,
                                                        int64_t num_rows,
                                                        const std::array<at::Tensor, 5>& host) {
  std::vector<std::optional<TokenLogprobs>> out(num_rows);
  if (logprob_rows.empty()) return out;
  const auto& [ids, logprob, ranks, top_values, top_ids] = host;
  const int64_t max_top = top_ids.size(1);
  for (size_t i = 0; i < logprob_rows.size(); ++i) {
    TokenLogprobs result;
    result.token_id = ids.data_ptr<int64_t>()[i];
    if (result.token_id < 0) continue;
    result.logprob = logprob.data_ptr<float>()[i];
    result.rank = ranks.data_ptr<int64_t>()[i];
    for (int64_t k = 0; k < num_top[i]; ++k) {
      result.top.emplace_back(top_ids.data_ptr<int64_t>()[i * max_top + k],
                              top_values.data_ptr<float>()[i * max_top + k]);
    }
    out[logprob_rows[i]] = std::move(result);
  }
  return out;
}

std::vector<std::optional<TokenLogprobs>> complete_logprobs(PendingLogprobs& pending,
                                                          const at::Tensor& tokens,
                                                          int64_t num_rows) {
  if (pending.rows.empty()) return std::vector<std::optional<TokenLogprobs>>(num_rows);
  std::array<at::Tensor, 5> host = gather_logprobs(pending, tokens);
  for (at::Tensor& t : host) t = t.cpu().contiguous();
  return read_logprobs(pending.rows, pending.num_top, num_rows, host);
}

// `t` copied to the host without waiting: pinned memory and a non-blocking copy off the CPU (the
// caller records an event after the copies), `t` itself on the CPU.
at::Tensor copy_to_host(const at::Tensor& t) {
  if (t.device().is_cpu()) return t.contiguous();
  at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  host.copy_(t, /*non_blocking=*/true);
  return host;
}

bool is_greedy(const SamplingParams& p) { return p.temperature < SamplingParams::kGreedyTemperature; }

// Temperature, top-k, top-p, min-p, then the draw (greedy rows draw nothing; without `draw` no
// row does, and only the greedy rows' argmax and the -1 of rows without a distribution mean
// anything). Returns int64 [rows] on the logits' device.
at::Tensor filter_and_draw(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                           bool draw = true) {
  const int64_t num_rows = logits.size(0);
  std::vector<float> temperature(num_rows), top_p(num_rows), min_p(num_rows);
  std::vector<float> uniform(num_rows, 0.0f);
  std::vector<int64_t> top_k(num_rows);
  bool any_filter = false;
  for (int64_t r = 0; r < num_rows; ++r) {
    const SamplingParams& p = *rows[r].params;
    // Below kGreedyTemperature the division would overflow fp32 (vLLM draws greedily there
    // too); above fp32's range the temperature is clamped, not turned into inf (-inf / inf is NaN).
    const bool greedy = is_greedy(p);
    temperature[r] = greedy ? 0.0f
                            : static_cast<float>(std::min<double>(
                                  p.temperature, std::numeric_limits<float>::max()));
    top_k[r] = p.top_k;
    top_p[r] = static_cast<float>(p.top_p);
    min_p[r] = static_cast<float>(p.min_p);
    if (!greedy) {
      if (draw) uniform[r] = rows[r].random->next_uniform();
      any_filter = true;
    }
  }
  const auto device = logits.device();
  at::Tensor temperature_t = to_tensor(temperature, device);
  if (any_filter) {
    ops::sampling_filter_logits(logits, temperature_t, to_tensor(top_k, device),
                                to_tensor(top_p, device), to_tensor(min_p, device));
  }
  // On the CPU the parameter tensors alias the vectors above, which outlive the ops.
  return ops::sampling_from_logits(logits, temperature_t, to_tensor(uniform, device));
}

// The distributions behind `tokens` (int64 [rows] on the CPU) from the logits filter_and_draw
// left: softmax for sampled rows, one-hot for greedy rows, zeros where the token is -1.
at::Tensor distributions(const at::Tensor& filtered, const at::Tensor& tokens,
                         const std::vector<SamplingRow>& rows) {
  std::vector<int64_t> zero_rows, one_rows, one_tokens;
  const int64_t* token = tokens.data_ptr<int64_t>();
  for (size_t r = 0; r < rows.size(); ++r) {
    const bool greedy = is_greedy(*rows[r].params);
    if (token[r] < 0 || greedy) zero_rows.push_back(static_cast<int64_t>(r));
    if (token[r] >= 0 && greedy) {
      one_rows.push_back(static_cast<int64_t>(r));
      one_tokens.push_back(token[r]);
    }
  }
  // Only rows that sample need the softmax (all-greedy batches skip it).
  const bool none_sampled = zero_rows.size() == rows.size();
  at::Tensor probs = none_sampled ? at::zeros_like(filtered) : at::softmax(filtered, 1);
  const at::Device device = probs.device();
  if (!zero_rows.empty() && !none_sampled) probs.index_fill_(0, to_tensor(zero_rows, device), 0.0);
  if (!one_rows.empty()) {
    const c10::List<std::optional<at::Tensor>> index{to_tensor(one_rows, device),
                                                     to_tensor(one_tokens, device)};
    probs.index_put_(index, at::scalar_tensor(1.0, probs.options()));
  }
  return probs;
}

// Logprobs alone need no random stream (need_random false).
void check_rows(const at::Tensor& logits, const std::vector<SamplingRow>& rows,
                bool need_random = true) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "Sampler: logits must be float32 [rows, vocab]");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == logits.size(0),
              "Sampler: need one SamplingParams and one random stream per row");
  for (const SamplingRow& row : rows) {
    TORCH_CHECK(row.params && (row.random || !need_random),
                "Sampler: every row needs params and a random stream");
  }
}

}  // namespace

SamplerOutput Sampler::sample(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                              bool want_probs) const {
  check_rows(logits, rows);
  PendingLogprobs pending = raw_logprobs(logits, rows);  // before anything changes the logits
  apply_history(logits, rows);
  SamplerOutput out;
  const at::Tensor tokens = filter_and_draw(logits, rows);
  out.logprobs = complete_logprobs(pending, tokens, static_cast<int64_t>(rows.size()));
  out.token_ids = tokens.cpu();
  if (want_probs) out.probs = distributions(logits, out.token_ids, rows);
  return out;
}

at::Tensor Sampler::probabilities(at::Tensor& logits, const std::vector<SamplingRow>& rows) const {
  check_rows(logits, rows);
  apply_history(logits, rows);
  const at::Tensor tokens = filter_and_draw(logits, rows, /*draw=*/false).cpu();
  return distributions(logits, tokens, rows);
}

PendingLogprobs Sampler::begin_logprobs(const at::Tensor& logits,
                                        const std::vector<SamplingRow>& rows) const {
  check_rows(logits, rows, /*need_random=*/false);
  return raw_logprobs(logits, rows);
}

std::vector<std::optional<TokenLogprobs>> Sampler::finish_logprobs(
    PendingLogprobs& pending, const at::Tensor& tokens, const std::vector<SamplingRow>& rows) const {
  return complete_logprobs(pending, tokens, static_cast<int64_t>(rows.size()));
}

PendingSamples Sampler::begin_sample(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                                     const at::Tensor& pending_tokens) const {
  check_rows(logits, rows);
  PendingLogprobs logprobs = raw_logprobs(logits, rows);  // before anything changes the logits
  apply_history(logits, rows, pending_tokens);
  PendingSamples pending;
  pending.token_ids = filter_and_draw(logits, rows);
  pending.num_rows = static_cast<int64_t>(rows.size());
  pending.host_ids = copy_to_host(pending.token_ids);
  if (!logprobs.rows.empty()) {
    const std::array<at::Tensor, 5> gathered = gather_logprobs(logprobs, pending.token_ids);
    pending.host_logprob = copy_to_host(gathered[1]);
    pending.host_rank = copy_to_host(gathered[2]);
    pending.host_top_values = copy_to_host(gathered[3]);
    pending.host_top_ids = copy_to_host(gathered[4]);
    pending.logprob_rows = std::move(logprobs.rows);
    pending.num_top = std::move(logprobs.num_top);
  }
  const at::Device device = logits.device();
  if (!device.is_cpu()) {
    const c10::impl::VirtualGuardImpl guard(device.type());
    pending.copied.emplace(device.type());
    pending.copied->record(guard.getStream(device));
  }
  return pending;
}

SamplerOutput Sampler::finish_sample(PendingSamples& pending) const {
  if (pending.copied) pending.copied->synchronize();
  SamplerOutput out;
  out.token_ids = pending.host_ids;
  if (!pending.logprob_rows.empty()) {
    const at::Tensor ids = pending.host_ids.index_select(
        0, to_tensor(pending.logprob_rows, at::kCPU));
    out.logprobs = read_logprobs(pending.logprob_rows, pending.num_top, pending.num_rows,
                                 {ids, pending.host_logprob, pending.host_rank,
                                  pending.host_top_values, pending.host_top_ids});
  } else {
    out.logprobs.resize(pending.num_rows);
  }
  return out;
}

at::Tensor Sampler::sample(at::Tensor& logits, const std::vector<const SamplingParams*>& params,
                           const std::vector<RequestRandom*>& randoms) const {
  TORCH_CHECK(params.size() == randoms.size() &&
                  static_cast<int64_t>(params.size()) == logits.size(0),
              "Sampler: need one SamplingParams and one random stream per row");
  std::vector<SamplingRow> rows(params.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    rows[r].params = params[r];
    rows[r].random = randoms[r];
  }
  check_rows(logits, rows);
  return filter_and_draw(logits, rows).cpu();
}

}  // namespace kvserve
