#pragma once
// What the engine shares with a KV connector (prefill/decode disaggregation): a request either
// holds its prompt's blocks after it finishes, for another engine to read (the producer), or
// has its prompt's KV written into its blocks by a transfer instead of computing it (the
// consumer). The transport itself is the connector's (python/kvserve/kv_transfer).

#include <cstdint>
#include <string>
#include <vector>

namespace kvserve {

/// A request's part in a KV transfer.
enum class KVTransfer {
  kNone,
  kHold,  ///< when it finishes (stop or length), its blocks stay held until release_kv
  kLoad,  ///< its prompt's KV is loaded into its blocks; it decodes from the loaded first token
};

/// A consumer request whose blocks are allocated and wait for their KV.
struct KVLoad {
  int64_t load_id = 0;  ///< what finish_kv_load / fail_kv_load name (one per admission)
  std::string request_id;
  int64_t num_prompt_tokens = 0;
  /// Prompt tokens whose KV this engine's prefix cache already holds (a multiple of the block
  /// size): their blocks are not to be written.
  int64_t num_cached_tokens = 0;
  /// Per group of layers, the request's block table (position p in block p / block_size).
  std::vector<std::vector<int32_t>> block_tables;
  /// A model with state-space layers: the request's state slot, which the transfer fills with
  /// the producer's state at the prompt's end (-1: no state pool).
  int32_t state_slot = -1;
};

/// The blocks a finished producer request holds.
struct HeldKV {
  std::vector<std::vector<int32_t>> block_tables;  ///< per group of layers
  int64_t num_tokens = 0;                           ///< tokens whose KV they hold
  int32_t state_slot = -1;  ///< the state after those tokens (-1: no state pool)
};

}  // namespace kvserve
