#include "kvserve/tensor_parallel_worker.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"
#include "kvserve/kv_cache_layout.h"
#include "kvserve/model_runner.h"
#include "models/draft_head.h"

namespace kvserve {

void send_to_workers(Communicator& control, WorkerCommand command,
                     const std::vector<int64_t>& payload) {
  at::Tensor header = at::tensor(
      std::vector<int64_t>{static_cast<int64_t>(command), static_cast<int64_t>(payload.size())});
  control.broadcast_(header, 0);
  if (payload.empty()) return;
  at::Tensor body = at::from_blob(const_cast<int64_t*>(payload.data()),
                                  {static_cast<int64_t>(payload.size())}, at::kLong)
                        .clone();
  control.broadcast_(body, 0);
}

std::pair<WorkerCommand, std::vector<int64_t>> receive_from_rank0(Communicator& control) {
  at::Tensor header = at::zeros({2}, at::kLong);
  control.broadcast_(header, 0);
  const int64_t* h = header.data_ptr<int64_t>();
  if (h[0] < static_cast<int64_t>(WorkerCommand::kStep) ||
      h[0] > static_cast<int64_t>(WorkerCommand::kDraftLogits) || h[1] < 0) {
    throw std::runtime_error("tensor-parallel worker: a message that is no command (" +
                             std::to_string(h[0]) + ", " + std::to_string(h[1]) + ")");
  }
  std::vector<int64_t> payload(static_cast<size_t>(h[1]));
  if (!payload.empty()) {
    at::Tensor body = at::zeros({h[1]}, at::kLong);
    control.broadcast_(body, 0);
    const int64_t* b = body.data_ptr<int64_t>();
    payload.assign(b, b + h[1]);
  }
  return {static_cast<WorkerCommand>(h[0]), std::move(payload)};
}

std::vector<int64_t> pack_step(const StepCopies& copies, const std::vector<int64_t>& logit_rows,
                               int64_t num_sampled_rows, const ForwardBatchBuilder& batch,
                               const TokenFeed* feed) {
  std::vector<int64_t> m;
  for (const auto* pairs : {&copies.blocks, &copies.states, &copies.snapshots}) {
    m.push_back(static_cast<int64_t>(pairs->size()));
    for (const auto& [src, dst] : *pairs) {
      m.push_back(src);
      m.push_back(dst);
    }
  }
  m.push_back(num_sampled_rows);
  m.push_back(static_cast<int64_t>(logit_rows.size()));
  m.insert(m.end(), logit_rows.begin(), logit_rows.end());
  const bool fed = feed && !feed->rows.empty();
  m.push_back(fed ? feed->tokens.size(0) : 0);
  m.push_back(fed ? static_cast<int64_t>(feed->rows.size()) : 0);
  if (fed) {
    m.insert(m.end(), feed->rows.begin(), feed->rows.end());
    m.insert(m.end(), feed->sources.begin(), feed->sources.end());
  }
  const std::vector<int64_t> packed = batch.pack();
  m.insert(m.end(), packed.begin(), packed.end());
  return m;
}

void send_fed_tokens(Communicator& ranks, const TokenFeed& feed) {
  if (feed.rows.empty()) return;
  at::Tensor tokens = feed.tokens.contiguous();  // read, not written, by the root
  ranks.broadcast_(tokens, 0);
}

namespace {

// The shape and dtype of a tensor that follows a message over the device group.
void put_shape(std::vector<int64_t>& m, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2, "a speculative head's rows must be [rows, width]");
  m.push_back(t.size(0));
  m.push_back(t.size(1));
  m.push_back(static_cast<int64_t>(t.scalar_type()));
}

void broadcast_rows(Communicator& ranks, const at::Tensor& rows) {
  if (rows.numel() == 0) return;  // the workers know the shape: they skip it too
  at::Tensor values = rows.contiguous();  // read, not written, by the root
  ranks.broadcast_(values, 0);
}

}  // namespace

void send_draft_depth(Communicator& control, Communicator& ranks, int64_t depth,
                      const std::vector<std::pair<int32_t, int32_t>>& copies,
                      const at::Tensor& previous, const ForwardBatchBuilder& batch) {
  std::vector<int64_t> m = {depth, static_cast<int64_t>(copies.size())};
  for (const auto& [src, dst] : copies) {
    m.push_back(src);
    m.push_back(dst);
  }
  put_shape(m, previous);
  const std::vector<int64_t> packed = batch.pack();
  m.insert(m.end(), packed.begin(), packed.end());
  send_to_workers(control, WorkerCommand::kDraft, m);
  broadcast_rows(ranks, previous);
}

void send_draft_logits(Communicator& control, Communicator& ranks, const at::Tensor& hidden) {
  std::vector<int64_t> m;
  put_shape(m, hidden);
  send_to_workers(control, WorkerCommand::kDraftLogits, m);
  broadcast_rows(ranks, hidden);
}

std::vector<int64_t> pack_lora(int64_t slot, const std::vector<LoraFactors>& worker_factors) {
  std::vector<int64_t> m = {slot, static_cast<int64_t>(worker_factors.size())};
  auto put_values = [&](const at::Tensor& t) {
    const at::Tensor values = t.to(at::kCPU, at::kFloat).contiguous();
    const size_t n = static_cast<size_t>(values.numel());
    const size_t offset = m.size();
    m.resize(offset + (n + 1) / 2, 0);
    std::memcpy(m.data() + offset, values.data_ptr<float>(), n * sizeof(float));
  };
  for (const LoraFactors& factors : worker_factors) {
    m.push_back(static_cast<int64_t>(factors.size()));
    for (const auto& [name, ab] : factors) {
      const auto& [a, b] = ab;
      TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "pack_lora: ", name, "'s factors must be 2-D");
      m.push_back(static_cast<int64_t>(name.size()));
      for (const char c : name) m.push_back(static_cast<unsigned char>(c));
      for (const at::Tensor* t : {&a, &b}) {
        m.push_back(t->size(0));
        m.push_back(t->size(1));
      }
      put_values(a);
      put_values(b);
    }
  }
  return m;
}

std::pair<int64_t, LoraFactors> unpack_lora(const std::vector<int64_t>& message, int64_t rank) {
  size_t pos = 0;
  auto next = [&]() {
    if (pos >= message.size()) {
      throw std::runtime_error("tensor-parallel worker: a short LoRA message");
    }
    return message[pos++];
  };
  auto small = [&](int64_t limit) {  // a count, length or size: 0..limit
    const int64_t v = next();
    if (v < 0 || v > limit) {
      throw std::runtime_error("tensor-parallel worker: a malformed LoRA message");
    }
    return v;
  };
  const int64_t slot = next();
  const int64_t workers = small(1 << 16);
  LoraFactors mine;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t targets = small(1 << 20);
    for (int64_t t = 0; t < targets; ++t) {
      const int64_t length = small(1 << 12);
      std::string name;
      for (int64_t i = 0; i < length; ++i) name.push_back(static_cast<char>(small(255)));
      at::Tensor ab[2];
      int64_t shape[4];
      for (int64_t& d : shape) d = small(int64_t{1} << 30);
      for (int i = 0; i < 2; ++i) {
        const int64_t n = shape[2 * i] * shape[2 * i + 1];
        const size_t words = static_cast<size_t>((n + 1) / 2);
        if (words > message.size() - pos) {
          throw std::runtime_error("tensor-parallel worker: a short LoRA message");
        }
        if (w + 1 == rank) {
          ab[i] = at::empty({shape[2 * i], shape[2 * i + 1]}, at::kFloat);
          std::memcpy(ab[i].data_ptr<float>(), message.data() + pos,
                      static_cast<size_t>(n) * sizeof(float));
        }
        pos += words;
      }
      if (w + 1 == rank) mine.emplace(std::move(name), std::make_pair(ab[0], ab[1]));
    }
  }
  if (pos != message.size()) {
    throw std::runtime_error("tensor-parallel worker: a malformed LoRA message");
  }
  return {slot, std::move(mine)};
}

namespace {

std::shared_ptr<Communicator> checked(std::shared_ptr<Communicator> control) {
  if (!control || control->size() < 2 || control->rank() == 0) {
    throw std::invalid_argument(
        "TensorParallelWorker: a worker is a rank > 0 of a group of "
        "several ranks");
  }
  return control;
}

}  // namespace

TensorParallelWorker::TensorParallelWorker(std::shared_ptr<CausalLM> model,
                                           std::shared_ptr<Communicator> control,
                                           TensorParallelWorkerOptions options,
                                           std::shared_ptr<DraftHead> head)
    : model_(std::move(model)),
      control_(checked(std::move(control))),
      // Grouped as ContinuousBatchingEngine groups its block manager without a draft model.
      kv_cache_(engine_helpers::make_kv_cache(
          *model_, options.num_blocks, options.block_size,
          KVCacheLayout::for_model(model_->config(), true).group_windows() !=
              std::vector<int64_t>{0},
          options.kv_cache_dtype, options.num_state_slots, options.ssm_state_dtype)),
      head_(std::move(head)) {
  if (head_) {
    if (!head_->ranks() || !model_->ranks()) {
      throw std::invalid_argument(
          "TensorParallelWorker: a worker's speculative head is split over the ranks with its "
          "model");
    }
    // As HeadProposer's pool on rank 0.
    head_cache_ = std::make_unique<PagedKVCache>(
        engine_helpers::make_kv_cache(*head_, options.num_blocks, options.block_size));
  }
}

void TensorParallelWorker::run_draft(WorkerCommand command, const std::vector<int64_t>& message) {
  if (!head_) {
    throw std::runtime_error(
        "tensor-parallel worker: rank 0 runs a split speculative head, this rank has none");
  }
  size_t pos = 0;
  const auto next = [&]() {
    if (pos >= message.size()) {
      throw std::runtime_error("tensor-parallel worker: a malformed draft message");
    }
    return message[pos++];
  };
  int64_t depth = 0;
  std::vector<std::pair<int32_t, int32_t>> copies;
  if (command == WorkerCommand::kDraft) {
    depth = next();
    const int64_t n = next();
    if (n < 0 || static_cast<size_t>(n) > (message.size() - pos) / 2) {
      throw std::runtime_error("tensor-parallel worker: a malformed draft message");
    }
    for (int64_t i = 0; i < n; ++i, pos += 2) {
      copies.emplace_back(static_cast<int32_t>(message[pos]),
                          static_cast<int32_t>(message[pos + 1]));
    }
  }
  const int64_t rows = next(), width = next(), dtype = next();
  if (rows < 0 || width < 1 || dtype < 0 ||
      dtype >= static_cast<int64_t>(at::ScalarType::NumOptions) ||
      (command == WorkerCommand::kDraftLogits && pos != message.size())) {
    throw std::runtime_error("tensor-parallel worker: a malformed draft message");
  }
  at::Tensor values =
      at::empty({rows, width}, at::TensorOptions()
                                   .dtype(static_cast<at::ScalarType>(dtype))
                                   .device(head_->device()));
  if (rows > 0) model_->ranks()->broadcast_(values, 0);
  try {
    if (command == WorkerCommand::kDraftLogits) {
      head_->compute_logits(values);
      return;
    }
    head_cache_->copy_blocks(copies);
    const std::vector<int64_t> packed(message.begin() + static_cast<std::ptrdiff_t>(pos),
                                      message.end());
    const ForwardBatch batch = ForwardBatchBuilder::unpack(packed).build(head_->device());
    head_->forward_depth(depth, batch.input_ids, values, batch.positions, batch.metadata,
                         head_cache_->layers());
  } catch (const std::exception&) {
    // Rank 0 runs the same on the same inputs and reports the failure.
  }
}

int64_t TensorParallelWorker::serve() {
  int64_t steps = 0;
  while (true) {
    auto [command, message] = receive_from_rank0(*control_);
    if (command == WorkerCommand::kStop) return steps;
    if (command == WorkerCommand::kDraft || command == WorkerCommand::kDraftLogits) {
      run_draft(command, message);
      continue;
    }
    if (command == WorkerCommand::kSetLora) {
      auto [slot, factors] = unpack_lora(message, control_->rank());
      try {
        if (factors.empty()) {
          model_->clear_lora(slot);
        } else {
          model_->set_lora(slot, factors);
        }
      } catch (const std::exception&) {
        // Rank 0 applied the same adapter's shard to its own targets first and reported it.
      }
      continue;
    }
    // The copies, then the logit rows, then the batch.
    size_t pos = 0;
    const auto count = [&](int64_t per_item) {
      if (pos >= message.size() || message[pos] < 0 ||
          static_cast<size_t>(message[pos] * per_item) > message.size() - pos - 1) {
        throw std::runtime_error("tensor-parallel worker: a malformed step message");
      }
      return message[pos++];
    };
    StepCopies copies;
    for (auto* pairs : {&copies.blocks, &copies.states, &copies.snapshots}) {
      for (int64_t i = 0, n = count(2); i < n; ++i, pos += 2) {
        pairs->emplace_back(static_cast<int32_t>(message[pos]),
                            static_cast<int32_t>(message[pos + 1]));
      }
    }
    if (pos >= message.size()) {
      throw std::runtime_error("tensor-parallel worker: a malformed step message");
    }
    const int64_t num_sampled_rows = message[pos++];
    const int64_t num_rows = count(1);
    if (num_sampled_rows < 0 || num_sampled_rows > num_rows) {
      throw std::runtime_error("tensor-parallel worker: a malformed step message");
    }
    const auto take = [&](int64_t n) {
      const auto first = message.begin() + static_cast<std::ptrdiff_t>(pos);
      pos += static_cast<size_t>(n);
      return std::vector<int64_t>(first, first + n);
    };
    const std::vector<int64_t> rows = take(num_rows);
    // The fed tokens' count, then the rows they fill and their sources among the tokens.
    if (pos >= message.size() || message[pos] < 0) {
      throw std::runtime_error("tensor-parallel worker: a malformed step message");
    }
    const int64_t num_fed_tokens = message[pos++];
    const int64_t num_fed_rows = count(2);
    TokenFeed feed;
    feed.rows = take(num_fed_rows);
    feed.sources = take(num_fed_rows);
    if ((num_fed_rows > 0) != (num_fed_tokens > 0)) {
      throw std::runtime_error("tensor-parallel worker: a malformed step message");
    }
    for (const int64_t source : feed.sources) {
      if (source < 0 || source >= num_fed_tokens) {
        throw std::runtime_error("tensor-parallel worker: a malformed step message");
      }
    }
    const std::vector<int64_t> packed(message.begin() + static_cast<std::ptrdiff_t>(pos),
                                      message.end());
    ++steps;
    try {
      if (num_fed_rows > 0) {  // rank 0 sends them after the message, whatever follows
        feed.tokens = at::empty({num_fed_tokens}, at::TensorOptions()
                                                      .dtype(at::kLong)
                                                      .device(model_->device()));
        const std::shared_ptr<Communicator> ranks = model_->ranks();
        if (!ranks) throw std::logic_error("tensor-parallel worker: the model has no ranks");
        ranks->broadcast_(feed.tokens, 0);
      }
      kv_cache_.copy_blocks(copies.blocks);
      kv_cache_.copy_states(copies.states);
      ForwardBatch batch = ForwardBatchBuilder::unpack(packed).build(model_->device());
      feed.apply(batch.input_ids);
      const at::Tensor hidden =
          model_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
      kv_cache_.copy_states(copies.snapshots);
      if (!rows.empty()) {
        const at::Tensor index =
            at::tensor(rows, at::TensorOptions().dtype(at::kLong)).to(hidden.device());
        for (const auto& [begin, length] : logits_slices(num_sampled_rows, num_rows)) {
          model_->compute_logits(hidden.index_select(0, index.narrow(0, begin, length)));
        }
      }
    } catch (const std::exception&) {
      // Rank 0 runs the same forward on the same inputs and reports the failure.
    }
  }
}

}  // namespace kvserve
