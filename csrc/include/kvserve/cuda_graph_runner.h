#pragma once
// Decode steps replayed from CUDA graphs. A decode step of B sequences (one new token each) is
// padded to the smallest captured size >= B (1, 2, 4, then multiples of 8) with rows that write
// nothing, its block tables padded to one width, and uploaded into the bytes the graph of that
// size reads; replaying the graph runs the whole forward with one launch instead of a few
// hundred. A size's graph is captured the first time a step of that size runs (after one eager
// forward, which warms every kernel and library handle). The graphs share one memory pool: they
// only ever replay one at a time, on the caller's stream.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/causal_lm.h"
#include "kvserve/forward_batch.h"

namespace kvserve {

class CudaGraphRunner {
 public:
  /// Graphs of `model` (on a CUDA device) for decode steps of up to max_batch sequences whose
  /// block tables hold at most table_width blocks.
  CudaGraphRunner(CausalLM& model, int64_t max_batch, int64_t table_width);
  ~CudaGraphRunner();
  CudaGraphRunner(const CudaGraphRunner&) = delete;
  CudaGraphRunner& operator=(const CudaGraphRunner&) = delete;

  /// Whether this build can capture graphs of `model`: a CUDA build, the model on a CUDA
  /// device, and a forward without host synchronisation or host-side tables whose decode steps
  /// all take one shape. Mixture-of-experts layers qualify (their kernels' pointer tables are
  /// uploaded once and kept), and so does multi-head latent attention unless it is forced to
  /// the expanded form (MLABatchPlan puts every decode step in one absorbed part).
  static bool supports(const CausalLM& model);

  /// The captured size a step of `num_sequences` decodes runs as, or 0 when no graph serves it
  /// (more sequences than max_batch, or a capture failed: then the runner warned on stderr and
  /// every later step runs eagerly).
  int64_t padded_size(int64_t num_sequences) const;
  int64_t table_width() const { return table_width_; }

  /// The forward of `builder`'s batch, built from one token per sequence, padded to a
  /// padded_size() with ForwardBatchBuilder::add_padding and with tables of at most
  /// table_width() blocks: hidden states [padded size, hidden_size], in memory that the next
  /// replay overwrites. Captures the size's graph first if it has none (that step's result comes
  /// from an eager forward). `feed` (may be null) fills tokens still on the device after the
  /// batch's upload.
  at::Tensor forward(const ForwardBatchBuilder& builder, const std::vector<LayerKVCache>& caches,
                     const TokenFeed* feed = nullptr);

  int64_t num_graphs() const;

 private:
  struct Graphs;
  CausalLM& model_;
  int64_t max_batch_, table_width_;
  bool disabled_ = false;
  std::vector<int64_t> sizes_;
  std::unique_ptr<Graphs> graphs_;
};

}  // namespace kvserve
