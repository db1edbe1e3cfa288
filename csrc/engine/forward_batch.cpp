#include "kvserve/forward_batch.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"

namespace kvserve {

using engine_helpers::to_tensor;
void ForwardBatchBuilder::add(const std::vector<int64_t>& tokens, int64_t num_cached,
                              const std::vector<int32_t>& block_table) {
  add_grouped(tokens, num_cached, std::vector<std::vector<int32_t>>{block_table});
}

void ForwardBatchBuilder::add_grouped(const std::vector<int64_t>& tokens, int64_t num_cached,
                                      const std::vector<std::vector<int32_t>>& group_tables) {
  const int64_t total = num_cached + static_cast<int64_t>(tokens.size());
  if (slots_.empty()) {
    slots_.resize(group_tables.size());
    block_tables_.resize(group_tables.size());
  }
  if (group_tables.size() != slots_.size()) {
    throw std::invalid_argument("a sequence with " + std::to_string(group_tables.size()) +
                                " block tables in a batch of " + std::to_string(slots_.size()));
  }
  for (const std::vector<int32_t>& table : group_tables) {
    if (total > static_cast<int64_t>(table.size()) * block_size_) {
      throw std::out_of_range("a sequence of " + std::to_string(total) +
                              " tokens does not fit its " + std::to_string(table.size()) +
                              " cache blocks");
    }
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t position = num_cached + static_cast<int64_t>(i);
    ids_.push_back(tokens[i]);
    positions_.push_back(position);
    for (size_t g = 0; g < group_tables.size(); ++g) {
      slots_[g].push_back(group_tables[g][position / block_size_] * block_size_ +
                          position % block_size_);
    }
  }
  query_start_loc_.push_back(static_cast<int32_t>(ids_.size()));
  seq_lens_.push_back(static_cast<int32_t>(total));
  logits_indices_.push_back(static_cast<int64_t>(ids_.size()) - 1);
  for (size_t g = 0; g < group_tables.size(); ++g) block_tables_[g].push_back(group_tables[g]);
}

namespace {

// [B, width] int32: the tables padded with block 0 to the longest.
at::Tensor padded_tables(const std::vector<std::vector<int32_t>>& tables, at::Device device) {
  size_t width = 1;
  for (const auto& table : tables) width = std::max(width, table.size());
  std::vector<int32_t> flat(tables.size() * width, 0);
  for (size_t b = 0; b < tables.size(); ++b) {
    std::copy(tables[b].begin(), tables[b].end(), flat.begin() + b * width);
  }
  return to_tensor(flat, device).view({static_cast<int64_t>(tables.size()),
                                       static_cast<int64_t>(width)});
}

}  // namespace

ForwardBatch ForwardBatchBuilder::build(at::Device device) const {
  ForwardBatch batch;
  batch.input_ids = to_tensor(ids_, device);
  batch.positions = to_tensor(positions_, device);
  batch.metadata.query_start_loc = to_tensor(query_start_loc_, device);
  batch.metadata.seq_lens = to_tensor(seq_lens_, device);
  const size_t groups = std::max<size_t>(1, slots_.size());
  for (size_t g = 0; g < groups; ++g) {
    at::Tensor slots = to_tensor(g < slots_.size() ? slots_[g] : std::vector<int64_t>{}, device);
    at::Tensor tables = padded_tables(
        g < block_tables_.size() ? block_tables_[g] : std::vector<std::vector<int32_t>>{}, device);
    if (g == 0) {
      batch.metadata.slot_mapping = slots;
      batch.metadata.block_tables = tables;
    } else {
      batch.metadata.group_slot_mappings.push_back(slots);
      batch.metadata.group_block_tables.push_back(tables);
    }
  }
  batch.logits_indices = to_tensor(logits_indices_, device);
  return batch;
}

}  // namespace kvserve
