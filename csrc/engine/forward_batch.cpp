#include "kvserve/forward_batch.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"

namespace kvserve {

using engine_helpers::to_tensor;
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
  batch.input_ids = to_tensor(ids_, device);
  batch.positions = to_tensor(positions_, device);
  batch.metadata.slot_mapping = to_tensor(slots_, device);
  batch.metadata.query_start_loc = to_tensor(query_start_loc_, device);
  batch.metadata.seq_lens = to_tensor(seq_lens_, device);
  batch.metadata.block_tables =
      to_tensor(tables, device).view({num_sequences(), static_cast<int64_t>(width)});
  batch.logits_indices = to_tensor(logits_indices_, device);
  return batch;
}

}  // namespace kvserve
