#pragma once
// Multi-token prediction (MTP) modules: DeepSeek-V3's and GLM-4.5's checkpoints store, after
// their last decoder layer, modules trained to predict tokens further ahead (DeepSeek-AI,
// "DeepSeek-V3 Technical Report", 2024, section 2.2). Module d reads the hidden state of the
// depth before it (the target model's final-norm hidden state for d = 0) and the embedding of the
// next token, each RMS-normed, projects their concatenation (embedding first) back to the hidden
// size, runs one decoder layer of the target's family, and normalises; the target's LM head
// turns that into logits. The modules share the target's embedding and LM head.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "layers/linear.h"
#include "layers/norm.h"
#include "models/draft_head.h"

namespace kvserve {

class MtpHead : public DraftHead {
 public:
  /// One module.
  struct Depth {
    /// One decoder layer of the target's family whose final norm is the module's output norm
    /// (the checkpoint's shared_head.norm); its own embedding and LM head are not used.
    std::shared_ptr<CausalLM> block;
    RMSNorm enorm, hnorm;  ///< of the token embedding and of the previous hidden state
    Linear eh_proj;        ///< [hidden, 2 * hidden]
  };

  /// config: the target's with num_layers = depths.size() (each module's layer keeps its own KV:
  /// KVCacheLayout::for_model(config) has one layer per depth). Throws std::invalid_argument on
  /// a module whose shapes or device do not fit the target.
  MtpHead(ModelConfig config, std::shared_ptr<CausalLM> target, std::vector<Depth> depths);

  int64_t num_depths() const override { return static_cast<int64_t>(depths_.size()); }

  /// The target's final-norm hidden states, as they are.
  at::Tensor target_states(const at::Tensor& hidden) override { return hidden; }

  /// Module `depth`: its normed outputs [R, hidden], which give its logits and which the next
  /// module reads (as transformers' MtpModel chains them).
  Output forward_depth(int64_t depth, const at::Tensor& input_ids, const at::Tensor& previous,
                       const at::Tensor& positions, const AttentionMetadata& metadata,
                       const std::vector<LayerKVCache>& kv_caches) override;

  /// The target's LM head.
  at::Tensor compute_logits(const at::Tensor& hidden) override;
  /// The target's device group: split over tensor-parallel ranks, the modules are split as the
  /// target is (each rank's blocks its shard), and every rank runs each depth
  /// (TensorParallelWorker).
  std::shared_ptr<Communicator> ranks() const override { return target_->ranks(); }
  const ModelConfig& config() const override { return config_; }
  /// The modules' own weights (the shared embedding and LM head are the target's).
  int64_t weight_bytes() const override;

 private:
  ModelConfig config_;
  std::vector<Depth> depths_;
};

}  // namespace kvserve
