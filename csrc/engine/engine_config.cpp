// resolve_engine_config: every EngineConfig option checked once, against the model that runs it,
// and the KV pool sized from a byte budget when no block count is given.
#include "kvserve/engine_config.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvserve/kv_cache_layout.h"
#include "kvserve/paged_block_manager.h"
#include "kvserve/paged_kv_cache.h"

namespace kvserve {
namespace {

[[noreturn]] void bad(const std::string& message) { throw std::invalid_argument(message); }

std::string number(int64_t value) { return std::to_string(value); }

/// The pool's blocks: a block holds its tokens in the model's pool and, with a draft model, in
/// the draft's pool (same block ids). A model with state-space layers spends state_bytes of the
/// budget on its state pool first; one without attention layers has blocks of no bytes (ids
/// that only count its tokens).
int64_t pool_blocks(const EngineConfig& c, const ModelConfig& model, at::ScalarType dtype,
                    const ModelConfig* draft, int64_t state_bytes) {
  // A draft model's pool shares the block tables, so then every layer keeps all its blocks
  // (no sliding-window groups); the draft's entries keep the model's dtype.
  const KVCacheLayout layout = KVCacheLayout::for_model(model, draft == nullptr);
  int64_t per_block = PagedKVCache::bytes_per_block(layout, c.block_size,
                                                    c.kv_cache_dtype.value_or(dtype));
  if (draft != nullptr) {
    per_block += PagedKVCache::bytes_per_block(KVCacheLayout::for_model(*draft), c.block_size,
                                               dtype);
  }
  const int64_t per_sequence = PagedBlockManager::max_blocks_held(
      layout.group_windows(), c.block_size, c.max_model_len, c.max_model_len,
      c.max_num_batched_tokens);
  const int64_t room = c.max_num_seqs * per_sequence + 1;
  if (c.kv_cache_memory > 0) {
    if (c.kv_cache_memory < state_bytes + 2 * per_block) {
      bad("kv_cache_memory must be at least 2 blocks (" + number(2 * per_block) + " bytes)" +
          (state_bytes > 0 ? " after the state pool (" + number(state_bytes) + " bytes)" : "") +
          ", got " + number(c.kv_cache_memory));
    }
    return per_block > 0 ? (c.kv_cache_memory - state_bytes) / per_block : room;
  }
  if (per_block == 0) return room;
  return std::max<int64_t>(
      2, std::min(room, std::max<int64_t>(0, kDefaultKVCacheMemory - state_bytes) / per_block));
}

}  // namespace

EngineConfig resolve_engine_config(EngineConfig c, const ModelConfig& model, at::ScalarType dtype,
                                   const ModelConfig* draft) {
  const int64_t limit = model.max_position_embeddings;
  // A model without attention layers has no position limit of its own (Mamba2); its blocks only
  // count tokens, and the default length keeps their tables short.
  if (c.max_model_len == 0) {
    c.max_model_len = model.num_kv_layers() > 0 ? limit
                                                : std::min(limit, kDefaultStateModelLen);
  }
  if (c.max_model_len < 2 || c.max_model_len > limit) {
    bad("max_model_len must be in [2, " + number(limit) + "] (the model's "
        "max_position_embeddings), got " + number(c.max_model_len));
  }
  if (draft != nullptr && draft->max_position_embeddings < c.max_model_len) {
    bad("the draft model handles " + number(draft->max_position_embeddings) +
        " positions, fewer than max_model_len " + number(c.max_model_len));
  }
  SchedulerConfig{c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len}.validate();
  if (c.block_size < 1) bad("block_size must be >= 1, got " + number(c.block_size));
  if (c.num_blocks != 0 && c.kv_cache_memory != 0) {
    bad("give num_blocks or kv_cache_memory, not both");
  }
  if (c.kv_cache_memory < 0) bad("kv_cache_memory must be >= 0, got " + number(c.kv_cache_memory));
  if (c.kv_cache_dtype && *c.kv_cache_dtype != dtype && !is_quantized_kv_dtype(*c.kv_cache_dtype)) {
    bad("kv_cache_dtype must be the model's dtype, int8 or float8_e4m3fn, got " +
        std::string(c10::toString(*c.kv_cache_dtype)));
  }
  const KVCacheLayout layout = KVCacheLayout::for_model(model);
  int64_t state_bytes = 0;
  if (draft != nullptr && KVCacheLayout::for_model(*draft).has_state()) {
    bad("a draft model with state-space layers (" + draft->architecture +
        ") is not supported: its states would have to go back with each rejected draft");
  }
  if (!layout.has_state() && c.num_state_snapshots != 0) {
    bad("num_state_snapshots is for models with state-space layers; " + model.architecture +
        " has none");
  }
  if (layout.has_state()) {
    if (c.ssm_state_dtype && *c.ssm_state_dtype != at::kFloat && *c.ssm_state_dtype != dtype) {
      bad("ssm_state_dtype must be float32 or the model's dtype, got " +
          std::string(c10::toString(*c.ssm_state_dtype)));
    }
    const bool speculative = !c.speculative.method.empty() || draft != nullptr;
    const std::vector<int64_t> group_windows = layout.group_windows();
    if (speculative && std::any_of(group_windows.begin(), group_windows.end(),
                                   [](int64_t window) { return window > 0; })) {
      bad("speculative decoding is not supported for models with state-space layers and "
          "sliding-window attention (" + model.architecture + ")");
    }
    if (c.num_state_snapshots < 0 || c.num_state_snapshots > kMaxStateSnapshots) {
      bad("num_state_snapshots must be in [0, " + number(kMaxStateSnapshots) + "], got " +
          number(c.num_state_snapshots));
    }
    // A hit needs a state saved at its boundary, and the snapshots' blocks a group of full
    // attention to be named by (a model whose every attention layer slides has none).
    const std::vector<int64_t> windows = layout.group_windows();
    const bool full_group = windows.empty() || windows.front() == 0;
    c.enable_prefix_caching = c.enable_prefix_caching && c.num_state_snapshots > 0 && full_group;
    if (!c.enable_prefix_caching) c.num_state_snapshots = 0;
    c.cuda_graph_max_batch = 0;       // the graphs capture attention-only batches
    const int64_t per_state =
        layout.state.bytes_per_sequence(dtype, c.ssm_state_dtype.value_or(at::kFloat));
    // With speculation, a backup of each sequence's state (PagedBlockManager::back_up_state).
    const int64_t states =
        c.max_num_seqs * (speculative ? 2 : 1) + c.num_state_snapshots;
    // Without a budget, the states alone may take what the default KV budget would.
    const int64_t budget = c.kv_cache_memory > 0 ? c.kv_cache_memory : kDefaultKVCacheMemory;
    if (per_state > 0 && states > budget / per_state) {
      bad("the state pool (max_num_seqs " + number(c.max_num_seqs) +
          (speculative ? " twice, with speculation's backups," : "") + " + num_state_snapshots " +
          number(c.num_state_snapshots) + " states of " + number(per_state) +
          " bytes) exceeds " + (c.kv_cache_memory > 0 ? "kv_cache_memory (" : "the default budget (") +
          number(budget) + " bytes): lower them" +
          (c.kv_cache_memory > 0 ? "" : ", or set kv_cache_memory"));
    }
    state_bytes = states * per_state;
  }
  if (c.num_blocks == 0) {
    c.num_blocks = pool_blocks(c, model, dtype, draft, state_bytes);
    c.kv_cache_memory = 0;  // spent: a resolved config names its blocks (and resolves again)
  }
  if (c.num_blocks < 2) {
    bad("num_blocks must be >= 2 (block 0 is the null block), got " + number(c.num_blocks));
  }
  c.speculative.validate();
  if (c.async_scheduling && (!c.speculative.method.empty() || draft != nullptr)) {
    bad("async_scheduling is not supported with speculative decoding yet");
  }
  if (c.max_logprobs < 0) bad("max_logprobs must be >= 0, got " + number(c.max_logprobs));
  if (c.cuda_graph_max_batch < 0) {
    bad("cuda_graph_max_batch must be >= 0, got " + number(c.cuda_graph_max_batch));
  }
  c.cuda_graph_max_batch = std::min(c.cuda_graph_max_batch, c.max_num_seqs);
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"max_stop_strings", c.max_stop_strings},
        {"max_stop_string_length", c.max_stop_string_length},
        {"max_waiting_requests", c.max_waiting_requests}}) {
    if (value < 0) bad(std::string(name) + " must be >= 0 (0: no limit), got " + number(value));
  }
  return c;
}

}  // namespace kvserve
