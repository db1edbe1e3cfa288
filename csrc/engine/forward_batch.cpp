#include "kvserve/forward_batch.h"

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvserve {
namespace {

template <typename T>
at::Tensor to_device(const std::vector<T>& values, at::ScalarType dtype, at::Device device) {
  const int64_t n = static_cast<int64_t>(values.size());
  // from_blob does not copy; `copy=true` makes the result own its memory on every device.
  return at::from_blob(const_cast<T*>(values.data()), {n}, at::TensorOptions().dtype(dtype))
      .to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace

void ForwardBatchBuilder::add(const std::vector<int64_t>& tokens, int64_t num_cached,
                              const std::vector<int32_t>& block_table) {
  const int64_t total = num_cached + static_cast<int64_t>(tokens.size());
  if (total > static_cast<int64_t>(block_table.size()) * block_size_) {
    throw std::out_of_range("a sequence of " + std::to_string(total) + " tokens does not fit its " +
                            std::to_string(block_table.size()) + " cache blocks");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t position = num_cached + static_cast<int64_t>(i);
    ids_.push_back(tokens[i]);
    positions_.push_back(position);
    slots_.push_back(block_table[position / block_size_] * block_size_ + position % block_size_);
  }
  query_start_loc_.push_back(static_cast<int32_t>(ids_.size()));
  seq_lens_.push_back(static_cast<int32_t>(total));
  logits_indices_.push_back(static_cast<int64_t>(ids_.size()) - 1);
  block_tables_.push_back(block_table);
}

ForwardBatch ForwardBatchBuilder::build(at::Device device) const {
  size_t width = 1;
  for (const auto& table : block_tables_) width = std::max(width, table.size());
  std::vector<int32_t> tables(block_tables_.size() * width, 0);
  for (size_t b = 0; b < block_tables_.size(); ++b) {
    std::copy(block_tables_[b].begin(), block_tables_[b].end(), tables.begin() + b * width);
  }
  ForwardBatch batch;
  batch.input_ids = to_device(ids_, at::kLong, device);
  batch.positions = to_device(positions_, at::kLong, device);
  batch.metadata.slot_mapping = to_device(slots_, at::kLong, device);
  batch.metadata.query_start_loc = to_device(query_start_loc_, at::kInt, device);
  batch.metadata.seq_lens = to_device(seq_lens_, at::kInt, device);
  batch.metadata.block_tables =
      to_device(tables, at::kInt, device).view({num_sequences(), static_cast<int64_t>(width)});
  batch.logits_indices = to_device(logits_indices_, at::kLong, device);
  return batch;
}

}  // namespace kvserve
