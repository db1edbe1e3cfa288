#include "kvserve/forward_batch.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "tensor_values.h"

namespace kvserve {
namespace {

using test_util::values;

TEST(ForwardBatchBuilder, FlattensPrefillsAndDecodesWithExactSlots) {
  ForwardBatchBuilder builder(/*block_size=*/4);
  builder.add({11, 12, 13, 14, 15}, /*num_cached=*/0, {7, 2});  // prefill across two blocks
  builder.add({21}, /*num_cached=*/6, {3, 9});                 // decode at position 6
  builder.add({31, 32}, /*num_cached=*/1, {5});                // chunk after a cached prefix
  const ForwardBatch b = builder.build(at::Device("cpu"));
  EXPECT_EQ(values<int64_t>(b.input_ids), (std::vector<int64_t>{11, 12, 13, 14, 15, 21, 31, 32}));
  EXPECT_EQ(values<int64_t>(b.positions), (std::vector<int64_t>{0, 1, 2, 3, 4, 6, 1, 2}));
  // slot = block_table[p / 4] * 4 + p % 4
  EXPECT_EQ(values<int64_t>(b.metadata.slot_mapping),
            (std::vector<int64_t>{28, 29, 30, 31, 8, 38, 21, 22}));
  EXPECT_EQ(values<int32_t>(b.metadata.query_start_loc), (std::vector<int32_t>{0, 5, 6, 8}));
  EXPECT_EQ(values<int32_t>(b.metadata.seq_lens), (std::vector<int32_t>{5, 7, 3}));
  EXPECT_EQ(b.metadata.block_tables.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(values<int32_t>(b.metadata.block_tables), (std::vector<int32_t>{7, 2, 3, 9, 5, 0}));
  EXPECT_EQ(values<int64_t>(b.logits_indices), (std::vector<int64_t>{4, 5, 7}));
  // On the CPU the host copies view the tensors' own bytes.
  const AttentionMetadata& m = b.metadata;
  EXPECT_EQ(m.host_query_start_loc.data_ptr(), m.query_start_loc.data_ptr());
  EXPECT_EQ(m.host_seq_lens.data_ptr(), m.seq_lens.data_ptr());
  EXPECT_EQ(m.host_block_tables.data_ptr(), m.block_tables.data_ptr());
  EXPECT_EQ(m.host_block_tables.sizes(), m.block_tables.sizes());
}

TEST(ForwardBatchBuilder, PadsADecodeBatchWithRowsThatWriteNothing) {
  // The padded decode batches that CudaGraphRunner replays: fixed row count and table width.
  ForwardBatchBuilder builder(/*block_size=*/4);
  builder.add({21}, /*num_cached=*/6, {3, 9});
  builder.add({31}, /*num_cached=*/0, {5});
  builder.add_padding();
  builder.add_padding();
  EXPECT_EQ(builder.num_sequences(), 4);
  EXPECT_EQ(builder.num_tokens(), 4);
  EXPECT_EQ(builder.max_table_blocks(), 2);
  const ForwardBatch b = builder.build(at::Device("cpu"), /*table_width=*/3);
  EXPECT_EQ(values<int64_t>(b.input_ids), (std::vector<int64_t>{21, 31, 0, 0}));
  EXPECT_EQ(values<int64_t>(b.positions), (std::vector<int64_t>{6, 0, 0, 0}));
  EXPECT_EQ(values<int64_t>(b.metadata.slot_mapping), (std::vector<int64_t>{38, 20, -1, -1}));
  EXPECT_EQ(values<int32_t>(b.metadata.query_start_loc), (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(values<int32_t>(b.metadata.seq_lens), (std::vector<int32_t>{7, 1, 1, 1}));
  EXPECT_EQ(b.metadata.block_tables.sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(values<int32_t>(b.metadata.block_tables),
            (std::vector<int32_t>{3, 9, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0}));
  // A table wider than table_width keeps its own width.
  EXPECT_EQ(builder.build(at::Device("cpu"), 1).metadata.block_tables.size(1), 2);
}

TEST(ForwardBatchBuilder, CarriesEachTokensLoraSlotWhenAsked) {
  ForwardBatchBuilder plain(4);
  plain.add({1, 2}, 0, {3}, /*lora_slot=*/2);
  EXPECT_FALSE(plain.build(at::Device("cpu")).metadata.lora_slots.defined());
  ForwardBatchBuilder builder(4, /*lora=*/true);
  builder.add({1, 2, 3}, 0, {3}, /*lora_slot=*/2);
  builder.add({4}, 5, {1, 6});
  builder.add({5, 6}, 0, {7}, /*lora_slot=*/0);
  builder.add_padding();
  EXPECT_EQ(values<int32_t>(builder.build(at::Device("cpu")).metadata.lora_slots),
            (std::vector<int32_t>{2, 2, 2, -1, 0, 0, -1}));
}

TEST(ForwardBatchBuilder, RejectsASequenceLongerThanItsBlocks) {
  ForwardBatchBuilder builder(4);
  EXPECT_THROW(builder.add({1, 2, 3}, 2, {0}), std::out_of_range);
  EXPECT_EQ(builder.num_sequences(), 0);
  EXPECT_NO_THROW(builder.add({1, 2}, 2, {0}));
}

TEST(ForwardBatchBuilder, PackedAndUnpackedBuildsTheSameBatch) {
  // What rank 0 sends a tensor-parallel worker: grouped tables, LoRA slots, a decode row.
  ForwardBatchBuilder builder(/*block_size=*/4, /*lora=*/true);
  builder.add_grouped({11, 12, 13, 14, 15}, 0, {{7, 2}, {4, 1}}, /*lora_slot=*/1);
  builder.add_grouped({21}, 6, {{3, 9}, {0, 8}});
  const std::vector<int64_t> message = builder.pack();
  const ForwardBatch want = builder.build(at::Device("cpu"));
  const ForwardBatch got = ForwardBatchBuilder::unpack(message).build(at::Device("cpu"));
  EXPECT_EQ(values<int64_t>(got.input_ids), values<int64_t>(want.input_ids));
  EXPECT_EQ(values<int64_t>(got.positions), values<int64_t>(want.positions));
  EXPECT_EQ(values<int64_t>(got.metadata.slot_mapping),
            values<int64_t>(want.metadata.slot_mapping));
  EXPECT_EQ(values<int64_t>(got.metadata.group_slot_mappings.at(0)),
            values<int64_t>(want.metadata.group_slot_mappings.at(0)));
  EXPECT_EQ(values<int32_t>(got.metadata.group_block_tables.at(0)),
            values<int32_t>(want.metadata.group_block_tables.at(0)));
  EXPECT_EQ(values<int32_t>(got.metadata.block_tables),
            values<int32_t>(want.metadata.block_tables));
  EXPECT_EQ(values<int32_t>(got.metadata.query_start_loc),
            values<int32_t>(want.metadata.query_start_loc));
  EXPECT_EQ(values<int32_t>(got.metadata.seq_lens), values<int32_t>(want.metadata.seq_lens));
  EXPECT_EQ(values<int32_t>(got.metadata.lora_slots), values<int32_t>(want.metadata.lora_slots));
  EXPECT_EQ(values<int64_t>(got.logits_indices), values<int64_t>(want.logits_indices));
  // A message cut short, with a value too many, or with a bad header is refused.
  std::vector<int64_t> cut(message.begin(), message.end() - 1), longer = message, bad = message;
  longer.push_back(0);
  bad[0] = 0;
  EXPECT_THROW(ForwardBatchBuilder::unpack(cut), std::invalid_argument);
  EXPECT_THROW(ForwardBatchBuilder::unpack(longer), std::invalid_argument);
  EXPECT_THROW(ForwardBatchBuilder::unpack(bad), std::invalid_argument);
  EXPECT_THROW(ForwardBatchBuilder::unpack({}), std::invalid_argument);
}

}  // namespace
}  // namespace kvserve
