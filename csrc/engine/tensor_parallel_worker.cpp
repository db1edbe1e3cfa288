#include "kvserve/tensor_parallel_worker.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"
#include "kvserve/kv_cache_layout.h"

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
  if ((h[0] != static_cast<int64_t>(WorkerCommand::kStep) &&
       h[0] != static_cast<int64_t>(WorkerCommand::kStop)) ||
      h[1] < 0) {
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

std::vector<int64_t> pack_step(const std::vector<std::pair<int32_t, int32_t>>& block_copies,
                               const std::vector<int64_t>& logit_rows,
                               const ForwardBatchBuilder& batch) {
  std::vector<int64_t> m = {static_cast<int64_t>(block_copies.size())};
  for (const auto& [src, dst] : block_copies) {
    m.push_back(src);
    m.push_back(dst);
  }
  m.push_back(static_cast<int64_t>(logit_rows.size()));
  m.insert(m.end(), logit_rows.begin(), logit_rows.end());
  const std::vector<int64_t> packed = batch.pack();
  m.insert(m.end(), packed.begin(), packed.end());
  return m;
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
                                           TensorParallelWorkerOptions options)
    : model_(std::move(model)),
      control_(checked(std::move(control))),
      // Grouped as ContinuousBatchingEngine groups its block manager without a draft model.
      kv_cache_(engine_helpers::make_kv_cache(
          *model_, options.num_blocks, options.block_size,
          KVCacheLayout::for_model(model_->config(), true).group_windows() !=
              std::vector<int64_t>{0},
          options.kv_cache_dtype)) {}

int64_t TensorParallelWorker::serve() {
  int64_t steps = 0;
  while (true) {
    auto [command, message] = receive_from_rank0(*control_);
    if (command == WorkerCommand::kStop) return steps;
    // The copies, then the logit rows, then the batch.
    size_t pos = 0;
    const auto count = [&](int64_t per_item) {
      if (pos >= message.size() || message[pos] < 0 ||
          static_cast<size_t>(message[pos] * per_item) > message.size() - pos - 1) {
        throw std::runtime_error("tensor-parallel worker: a malformed step message");
      }
      return message[pos++];
    };
    std::vector<std::pair<int32_t, int32_t>> copies;
    for (int64_t i = 0, n = count(2); i < n; ++i, pos += 2) {
      copies.emplace_back(static_cast<int32_t>(message[pos]),
                          static_cast<int32_t>(message[pos + 1]));
    }
    const int64_t num_rows = count(1);
    const std::vector<int64_t> rows(message.begin() + static_cast<std::ptrdiff_t>(pos),
                                    message.begin() + static_cast<std::ptrdiff_t>(pos + num_rows));
    const std::vector<int64_t> packed(message.begin() + static_cast<std::ptrdiff_t>(pos + num_rows),
                                      message.end());
    ++steps;
    try {
      kv_cache_.copy_blocks(copies);
      const ForwardBatch batch = ForwardBatchBuilder::unpack(packed).build(model_->device());
      const at::Tensor hidden =
          model_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
      if (!rows.empty()) {
        model_->compute_logits(hidden.index_select(
            0, at::tensor(rows, at::TensorOptions().dtype(at::kLong)).to(hidden.device())));
      }
    } catch (const std::exception&) {
      // Rank 0 runs the same forward on the same inputs and reports the failure.
    }
  }
}

}  // namespace kvserve
