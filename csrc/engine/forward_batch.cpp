#include "kvserve/forward_batch.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <stdexcept>
#include <string>

#include "engine/engine_helpers.h"

namespace kvserve {

void ForwardBatchBuilder::add(const std::vector<int64_t>& tokens, int64_t num_cached,
                              const std::vector<int32_t>& block_table, int32_t lora_slot,
                              int32_t state_slot) {
  add_grouped(tokens, num_cached, std::vector<std::vector<int32_t>>{block_table}, lora_slot,
              state_slot);
}

void ForwardBatchBuilder::add_grouped(const std::vector<int64_t>& tokens, int64_t num_cached,
                                      const std::vector<std::vector<int32_t>>& group_tables,
                                      int32_t lora_slot, int32_t state_slot) {
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
    lora_slots_.push_back(lora_slot);
    for (size_t g = 0; g < group_tables.size(); ++g) {
      slots_[g].push_back(group_tables[g][position / block_size_] * block_size_ +
                          position % block_size_);
    }
  }
  query_start_loc_.push_back(static_cast<int32_t>(ids_.size()));
  seq_lens_.push_back(static_cast<int32_t>(total));
  logits_indices_.push_back(static_cast<int64_t>(ids_.size()) - 1);
  for (size_t g = 0; g < group_tables.size(); ++g) block_tables_[g].push_back(group_tables[g]);
  state_slots_.push_back(state_slot);
  has_initial_state_.push_back(num_cached > 0 ? 1 : 0);
}

void ForwardBatchBuilder::add_padding() {
  if (slots_.empty()) {
    slots_.resize(1);
    block_tables_.resize(1);
  }
  ids_.push_back(0);
  positions_.push_back(0);
  lora_slots_.push_back(-1);
  for (size_t g = 0; g < slots_.size(); ++g) {
    slots_[g].push_back(-1);
    block_tables_[g].emplace_back();
  }
  query_start_loc_.push_back(static_cast<int32_t>(ids_.size()));
  seq_lens_.push_back(1);
  logits_indices_.push_back(static_cast<int64_t>(ids_.size()) - 1);
  state_slots_.push_back(-1);
  has_initial_state_.push_back(0);
}

// The message: block_size, lora, tokens T, sequences B, groups G; ids, positions, lora slots
// [T]; query_start_loc [B + 1]; seq_lens, logits_indices, state slots and initial-state flags
// [B]; per group its slots [T], then per
// sequence its table's length and blocks.
std::vector<int64_t> ForwardBatchBuilder::pack() const {
  const size_t tokens = ids_.size(), sequences = seq_lens_.size();
  std::vector<int64_t> m = {block_size_, lora_ ? 1 : 0, static_cast<int64_t>(tokens),
                            static_cast<int64_t>(sequences), static_cast<int64_t>(slots_.size())};
  m.insert(m.end(), ids_.begin(), ids_.end());
  m.insert(m.end(), positions_.begin(), positions_.end());
  m.insert(m.end(), lora_slots_.begin(), lora_slots_.end());
  m.insert(m.end(), query_start_loc_.begin(), query_start_loc_.end());
  m.insert(m.end(), seq_lens_.begin(), seq_lens_.end());
  m.insert(m.end(), logits_indices_.begin(), logits_indices_.end());
  m.insert(m.end(), state_slots_.begin(), state_slots_.end());
  m.insert(m.end(), has_initial_state_.begin(), has_initial_state_.end());
  for (size_t g = 0; g < slots_.size(); ++g) {
    m.insert(m.end(), slots_[g].begin(), slots_[g].end());
    for (const std::vector<int32_t>& table : block_tables_[g]) {
      m.push_back(static_cast<int64_t>(table.size()));
      m.insert(m.end(), table.begin(), table.end());
    }
  }
  return m;
}

ForwardBatchBuilder ForwardBatchBuilder::unpack(const std::vector<int64_t>& message) {
  size_t at = 0;
  const auto take = [&](size_t count) {
    if (count > message.size() - at) {
      throw std::invalid_argument("ForwardBatchBuilder::unpack: a message of " +
                                  std::to_string(message.size()) + " values ends early");
    }
    const auto first = message.begin() + static_cast<std::ptrdiff_t>(at);
    at += count;
    return std::make_pair(first, first + static_cast<std::ptrdiff_t>(count));
  };
  const auto [head, head_end] = take(5);
  const int64_t tokens = head[2], sequences = head[3], groups = head[4];
  if (head[0] < 1 || tokens < 0 || sequences < 0 || groups < 0 ||
      tokens > static_cast<int64_t>(message.size()) ||
      sequences > static_cast<int64_t>(message.size()) ||
      groups > static_cast<int64_t>(message.size())) {
    throw std::invalid_argument("ForwardBatchBuilder::unpack: not a packed batch");
  }
  ForwardBatchBuilder b(head[0], head[1] != 0);
  const auto fill = [&](auto& out, size_t count) {
    const auto [first, last] = take(count);
    out.assign(first, last);
  };
  const auto t = static_cast<size_t>(tokens), n = static_cast<size_t>(sequences);
  fill(b.ids_, t);
  fill(b.positions_, t);
  fill(b.lora_slots_, t);
  fill(b.query_start_loc_, n + 1);
  fill(b.seq_lens_, n);
  fill(b.logits_indices_, n);
  fill(b.state_slots_, n);
  fill(b.has_initial_state_, n);
  b.slots_.resize(static_cast<size_t>(groups));
  b.block_tables_.resize(static_cast<size_t>(groups));
  for (size_t g = 0; g < static_cast<size_t>(groups); ++g) {
    fill(b.slots_[g], t);
    b.block_tables_[g].resize(n);
    for (size_t i = 0; i < n; ++i) {
      const auto [length, unused] = take(1);
      if (*length < 0) throw std::invalid_argument("ForwardBatchBuilder::unpack: a bad table");
      fill(b.block_tables_[g][i], static_cast<size_t>(*length));
    }
  }
  if (at != message.size()) {
    throw std::invalid_argument("ForwardBatchBuilder::unpack: " +
                                std::to_string(message.size() - at) + " values left over");
  }
  return b;
}

int64_t ForwardBatchBuilder::max_table_blocks() const {
  size_t width = 0;
  for (const auto& group : block_tables_) {
    for (const auto& table : group) width = std::max(width, table.size());
  }
  return static_cast<int64_t>(width);
}

namespace {

// [B * width] int32: the tables padded with block 0 to the longest (at least min_width), and
// the width.
std::pair<std::vector<int32_t>, int64_t> padded_tables(
    const std::vector<std::vector<int32_t>>& tables, int64_t min_width) {
  size_t width = static_cast<size_t>(std::max<int64_t>(min_width, 1));
  for (const auto& table : tables) width = std::max(width, table.size());
  std::vector<int32_t> flat(tables.size() * width, 0);
  for (size_t b = 0; b < tables.size(); ++b) {
    std::copy(tables[b].begin(), tables[b].end(), flat.begin() + b * width);
  }
  return {std::move(flat), static_cast<int64_t>(width)};
}

// Host vectors bound for one device. On the CPU each becomes its own tensor; elsewhere they are
// packed into one pinned buffer and uploaded with one asynchronous copy (into `storage` when
// given), then viewed in place, on the device and in the pinned buffer.
class Upload {
 public:
  Upload(at::Device device, const at::Tensor& storage) : device_(device), storage_(storage) {}

  template <typename T>
  size_t add(const std::vector<T>& values) {
    static_assert(std::is_same_v<T, int64_t> || std::is_same_v<T, int32_t> ||
                  std::is_same_v<T, uint8_t>);
    pieces_.push_back({values.data(), values.size() * sizeof(T), values.size(),
                       std::is_same_v<T, int64_t>   ? at::kLong
                       : std::is_same_v<T, int32_t> ? at::kInt
                                                    : at::kBool});
    return pieces_.size() - 1;
  }

  struct Tensors {
    std::vector<at::Tensor> device, host;  // host: the same values, readable without waiting
  };

  /// The tensors, in the order they were added; `storage` gets the bytes they view (off the
  /// CPU).
  Tensors finish(at::Tensor& storage) const {
    Tensors out;
    if (device_.is_cpu()) {
      for (const Piece& p : pieces_) {
        out.device.push_back(at::from_blob(const_cast<void*>(p.data),
                                           {static_cast<int64_t>(p.count)},
                                           at::TensorOptions().dtype(p.dtype))
                                 .clone());
      }
      out.host = out.device;
      return out;
    }
    std::vector<size_t> offsets;
    size_t total = 0;
    for (const Piece& p : pieces_) {
      offsets.push_back(total);
      total += (p.bytes + 7) / 8 * 8;  // every view starts 8-byte aligned
    }
    at::Tensor host = at::empty({static_cast<int64_t>(std::max<size_t>(total, 8))},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* base = static_cast<uint8_t*>(host.data_ptr());
    for (size_t i = 0; i < pieces_.size(); ++i) {
      if (pieces_[i].bytes > 0) std::memcpy(base + offsets[i], pieces_[i].data, pieces_[i].bytes);
    }
    at::Tensor device;
    if (storage_.defined()) {
      if (storage_.numel() != host.numel() || storage_.device() != device_) {
        throw std::invalid_argument("ForwardBatchBuilder: a batch of another layout than its "
                                    "storage");
      }
      device = storage_;
      device.copy_(host, /*non_blocking=*/true);
    } else {
      device = host.to(device_, /*non_blocking=*/true);
    }
    storage = device;
    auto view = [&](const at::Tensor& bytes, size_t i) {
      return bytes.narrow(0, static_cast<int64_t>(offsets[i]),
                          static_cast<int64_t>(pieces_[i].bytes))
          .view(pieces_[i].dtype);
    };
    for (size_t i = 0; i < pieces_.size(); ++i) {
      out.device.push_back(view(device, i));
      out.host.push_back(view(host, i));
    }
    return out;
  }

 private:
  struct Piece {
    const void* data;
    size_t bytes, count;
    at::ScalarType dtype;
  };
  at::Device device_;
  at::Tensor storage_;
  std::vector<Piece> pieces_;
};

}  // namespace

ForwardBatch ForwardBatchBuilder::build(at::Device device, int64_t table_width,
                                        const at::Tensor& storage) const {
  const size_t groups = std::max<size_t>(1, slots_.size());
  std::vector<std::vector<int64_t>> slots(groups);
  std::vector<std::pair<std::vector<int32_t>, int64_t>> tables(groups);
  for (size_t g = 0; g < groups; ++g) {
    if (g < slots_.size()) slots[g] = slots_[g];
    tables[g] = padded_tables(g < block_tables_.size() ? block_tables_[g]
                                                       : std::vector<std::vector<int32_t>>{},
                              table_width);
  }
  Upload upload(device, storage);
  upload.add(ids_);
  upload.add(positions_);
  upload.add(query_start_loc_);
  upload.add(seq_lens_);
  upload.add(logits_indices_);
  for (size_t g = 0; g < groups; ++g) {
    upload.add(slots[g]);
    upload.add(tables[g].first);
  }
  if (lora_) upload.add(lora_slots_);
  const bool states = std::any_of(state_slots_.begin(), state_slots_.end(),
                                  [](int32_t slot) { return slot >= 0; });
  if (states) {
    upload.add(state_slots_);
    upload.add(has_initial_state_);
  }
  ForwardBatch batch;
  const Upload::Tensors uploaded = upload.finish(batch.storage);
  const std::vector<at::Tensor>& t = uploaded.device;
  const size_t tail = states ? 2 : 0;
  if (lora_) batch.metadata.lora_slots = t[t.size() - 1 - tail];
  if (states) {
    batch.metadata.state_slots = t[t.size() - 2];
    batch.metadata.has_initial_state = t[t.size() - 1];
  }
  batch.input_ids = t[0];
  batch.positions = t[1];
  batch.metadata.query_start_loc = t[2];
  batch.metadata.seq_lens = t[3];
  batch.metadata.host_query_start_loc = uploaded.host[2];
  batch.metadata.host_seq_lens = uploaded.host[3];
  batch.logits_indices = t[4];
  for (size_t g = 0; g < groups; ++g) {
    const at::Tensor& group_slots = t[5 + 2 * g];
    const std::vector<int64_t> shape = {
        static_cast<int64_t>(tables[g].first.size()) / tables[g].second, tables[g].second};
    const at::Tensor group_tables = t[6 + 2 * g].view(shape);
    if (g == 0) {
      batch.metadata.slot_mapping = group_slots;
      batch.metadata.block_tables = group_tables;
      batch.metadata.host_block_tables = uploaded.host[6].view(shape);
    } else {
      batch.metadata.group_slot_mappings.push_back(group_slots);
      batch.metadata.group_block_tables.push_back(group_tables);
    }
  }
  return batch;
}

void TokenFeed::apply(at::Tensor& input_ids) const {
  if (rows.empty()) return;
  const at::Device device = input_ids.device();
  const at::Tensor fed =
      tokens.index_select(0, engine_helpers::to_tensor(sources, device)).clamp_min_(0);
  input_ids.index_copy_(0, engine_helpers::to_tensor(rows, device), fed);
}

}  // namespace kvserve
