// MLABatchPlan: which form attends each sequence, and the metadata of each part; a decode batch
// is planned from the host copies alone (what lets CudaGraphRunner capture DeepSeek's decode).
#include "layers/mla_attention.h"

#include <ATen/ops/empty.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "kvserve/forward_batch.h"

#include "tensor_values.h"

namespace kvserve {
namespace {

using test_util::values;

// DeepSeek-V2-Lite's latent shape.
MLAConfig lite() {
  MLAConfig c;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  return c;
}

// Metadata whose device tensors live on the meta device (holding no values: reading one throws)
// and whose host copies come from `batch`: what a plan may read is only the host copies.
AttentionMetadata unreadable_device(const ForwardBatch& batch) {
  AttentionMetadata m = batch.metadata;
  auto meta = [](const at::Tensor& t) {
    return at::empty(t.sizes(), t.options().device(at::kMeta));
  };
  m.query_start_loc = meta(m.query_start_loc);
  m.seq_lens = meta(m.seq_lens);
  m.block_tables = meta(m.block_tables);
  return m;
}

TEST(MLABatchPlan, ADecodeBatchIsOneAbsorbedPartOverTheBatchsOwnMetadata) {
  ForwardBatchBuilder builder(/*block_size=*/4);
  builder.add({5}, /*num_cached=*/9, {1, 2, 3});
  builder.add({6}, /*num_cached=*/0, {4});  // a one-token prompt: absorbed too
  builder.add_padding();
  const AttentionMetadata m = unreadable_device(builder.build(at::Device("cpu")));
  for (const char* path : {"auto", "absorbed"}) {
    const MLABatchPlan plan = MLABatchPlan::make(m, lite(), 4, path);
    EXPECT_TRUE(plan.expanded.empty());
    EXPECT_EQ(plan.absorbed.num_tokens, 3);
    EXPECT_FALSE(plan.absorbed.token_index.defined());
    EXPECT_TRUE(plan.absorbed.query_start_loc.is_same(m.query_start_loc));
    EXPECT_TRUE(plan.absorbed.seq_lens.is_same(m.seq_lens));
    EXPECT_TRUE(plan.absorbed.block_tables.is_same(m.block_tables));
  }
  // Without host copies the plan has to read the device tensors: here it cannot.
  AttentionMetadata no_copies = m;
  no_copies.host_query_start_loc = no_copies.host_seq_lens = at::Tensor();
  EXPECT_ANY_THROW(MLABatchPlan::make(no_copies, lite(), 4, "auto"));
}

TEST(MLABatchPlan, APrefillNextToDecodesIsExpandedOverItsGatheredBlocks) {
  ForwardBatchBuilder builder(/*block_size=*/4);
  builder.add({7}, /*num_cached=*/5, {8, 9});                         // decode: absorbed
  builder.add(std::vector<int64_t>(10, 1), /*num_cached=*/0, {3, 6, 2});  // prefill: expanded
  builder.add({8, 9}, /*num_cached=*/2, {5});                         // 2 tokens, context 4
  const ForwardBatch batch = builder.build(at::Device("cpu"));
  const MLABatchPlan plan = MLABatchPlan::make(batch.metadata, lite(), 4, "auto");
  // Absorbed: rows 0 and 11-12 of the batch (the third sequence's queries are 2 tokens over a
  // context of 4: absorbed costs 2 x 4 x 1,088 + 2 x 131,072, expanded 4 x 131,072 + 2 x 4 x 320).
  EXPECT_EQ(values<int64_t>(plan.absorbed.token_index), (std::vector<int64_t>{0, 11, 12}));
  EXPECT_EQ(values<int32_t>(plan.absorbed.query_start_loc), (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(values<int32_t>(plan.absorbed.seq_lens), (std::vector<int32_t>{6, 4}));
  EXPECT_EQ(values<int32_t>(plan.absorbed.block_tables), (std::vector<int32_t>{8, 9, 0, 5, 0, 0}));
  // Expanded: the prefill's rows 1-10, its table indexing the 3 blocks gathered for it.
  EXPECT_EQ(plan.expanded.num_tokens, 10);
  EXPECT_EQ(values<int64_t>(plan.expanded.token_index).front(), 1);
  EXPECT_EQ(values<int32_t>(plan.expanded.seq_lens), (std::vector<int32_t>{10}));
  EXPECT_EQ(values<int64_t>(plan.expanded.gather_blocks), (std::vector<int64_t>{3, 6, 2}));
  EXPECT_EQ(values<int32_t>(plan.expanded.block_tables), (std::vector<int32_t>{0, 1, 2}));
  // The host copies give the same plan as the tensors do.
  AttentionMetadata device_only = batch.metadata;
  device_only.host_query_start_loc = device_only.host_seq_lens = at::Tensor();
  device_only.host_block_tables = at::Tensor();
  const MLABatchPlan again = MLABatchPlan::make(device_only, lite(), 4, "auto");
  EXPECT_EQ(values<int64_t>(again.absorbed.token_index), (std::vector<int64_t>{0, 11, 12}));
  EXPECT_EQ(values<int64_t>(again.expanded.gather_blocks), (std::vector<int64_t>{3, 6, 2}));
}

TEST(MLABatchPlan, AForcedPathTakesEverySequence) {
  ForwardBatchBuilder builder(/*block_size=*/4);
  builder.add({7}, /*num_cached=*/5, {8, 9});
  builder.add(std::vector<int64_t>(10, 1), /*num_cached=*/0, {3, 6, 2});
  const ForwardBatch batch = builder.build(at::Device("cpu"));
  const MLABatchPlan expanded = MLABatchPlan::make(batch.metadata, lite(), 4, "expanded");
  EXPECT_TRUE(expanded.absorbed.empty());
  EXPECT_FALSE(expanded.expanded.token_index.defined());  // every row, in order
  EXPECT_EQ(values<int64_t>(expanded.expanded.gather_blocks),
            (std::vector<int64_t>{8, 9, 3, 6, 2}));
  const MLABatchPlan absorbed = MLABatchPlan::make(batch.metadata, lite(), 4, "absorbed");
  EXPECT_TRUE(absorbed.expanded.empty());
  EXPECT_EQ(absorbed.absorbed.num_tokens, 11);
  EXPECT_THROW(MLABatchPlan::make(batch.metadata, lite(), 4, "fast"), std::invalid_argument);
}

}  // namespace
}  // namespace kvserve
