#pragma once
// The flattened tensors of one forward pass, and a builder that appends sequences to them.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kvserve/attention_metadata.h"

namespace kvserve {

/// Inputs of CausalLM::forward for T tokens from B sequences, plus where to take logits.
struct ForwardBatch {
  at::Tensor input_ids;       ///< int64 [T]
  at::Tensor positions;       ///< int64 [T]
  AttentionMetadata metadata;
  at::Tensor logits_indices;  ///< int64 [B]: the last token of each sequence
  /// Off the CPU: the device bytes that every tensor above views (the batch's one upload).
  at::Tensor storage;
};

/// Tokens of a batch that an earlier step sampled and that are still on the device only
/// (asynchronous scheduling): row rows[i] of the batch's input_ids takes tokens[sources[i]]
/// (a token below 0, a sample that failed, feeds 0: its request ends with an error).
struct TokenFeed {
  at::Tensor tokens;  ///< int64 on the batch's device (PendingSamples::token_ids)
  std::vector<int64_t> rows, sources;

  /// Writes the fed tokens into `input_ids` (int64 [T] on the tokens' device), in stream order.
  void apply(at::Tensor& input_ids) const;
};

/// Collects sequences (new tokens + where their context lives in the cache) into a ForwardBatch.
class ForwardBatchBuilder {
 public:
  /// block_size: tokens per cache block (a contiguous KVCache is one block of max_seq_len).
  /// lora: the batch carries metadata.lora_slots (a model that serves LoRA adapters).
  explicit ForwardBatchBuilder(int64_t block_size, bool lora = false)
      : block_size_(block_size), lora_(lora) {}

  /// Appends `tokens` of a sequence whose cache already holds `num_cached` tokens; position p of
  /// the sequence lives in block block_table[p / block_size]. lora_slot: its adapter's slot, or
  /// -1. state_slot: its slot in the state pool of a model with state-space layers (-1: none;
  /// the state holds its num_cached tokens, none when that is 0). Throws std::out_of_range when
  /// the table is too short for the new tokens.
  void add(const std::vector<int64_t>& tokens, int64_t num_cached,
           const std::vector<int32_t>& block_table, int32_t lora_slot = -1,
           int32_t state_slot = -1);
  /// The same for a pool whose layers are grouped: one block table per group (every builder of a
  /// batch adds the same number of groups).
  void add_grouped(const std::vector<int64_t>& tokens, int64_t num_cached,
                   const std::vector<std::vector<int32_t>>& group_tables, int32_t lora_slot = -1,
                   int32_t state_slot = -1);

  /// Appends a sequence that only fills a row of a padded batch (CudaGraphRunner): one token 0
  /// at position 0 whose K/V is not written (slot -1), attending to block 0 through an empty
  /// table; its outputs mean nothing and nothing reads them.
  void add_padding();

  /// The tensors on `device`; block tables padded with block 0 to the longest, or to
  /// `table_width` blocks if that is wider. Off the CPU, with `storage` (a previous build's,
  /// same sequences, tokens and table widths), the batch is uploaded into those bytes and its
  /// tensors view them, at the addresses of that build; throws std::invalid_argument if the
  /// layout differs.
  ForwardBatch build(at::Device device, int64_t table_width = 0,
                     const at::Tensor& storage = {}) const;

  /// Everything added so far as one message of int64 values, and the builder back from one:
  /// another rank of a tensor-parallel model builds the same batch (TensorParallelWorker).
  /// unpack throws std::invalid_argument for a message that pack did not write.
  std::vector<int64_t> pack() const;
  static ForwardBatchBuilder unpack(const std::vector<int64_t>& message);

  int64_t num_sequences() const { return static_cast<int64_t>(seq_lens_.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(ids_.size()); }
  /// Blocks in the longest block table of any group.
  int64_t max_table_blocks() const;

 private:
  int64_t block_size_;
  bool lora_;
  std::vector<int32_t> lora_slots_;  // [token]
  std::vector<int64_t> ids_, positions_, logits_indices_;
  std::vector<int32_t> query_start_loc_{0}, seq_lens_;
  std::vector<int32_t> state_slots_;      // [sequence]; all -1 without states
  std::vector<uint8_t> has_initial_state_;  // [sequence]
  std::vector<std::vector<int64_t>> slots_;                     // [group][token]
  std::vector<std::vector<std::vector<int32_t>>> block_tables_;  // [group][sequence]
};

}  // namespace kvserve
