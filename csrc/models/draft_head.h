#pragma once
// A speculative head: modules that draft from the target model's hidden states rather than from
// tokens alone (multi-token prediction, models/mtp_head.h; EAGLE-3, models/eagle3_head.h).
// HeadProposer (kvserve/head_proposer.h) runs them. A head is a CausalLM for the engine's sake
// (its config() gives the KV pool one layer per depth, and its memory counts as a draft model's),
// but it runs only through forward_depth.

#include <ATen/core/Tensor.h>

#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kvserve/causal_lm.h"

namespace kvserve {

class DraftHead : public CausalLM {
 public:
  /// target: the model the head drafts for (its dtype and device are the head's).
  explicit DraftHead(std::shared_ptr<CausalLM> target) : target_(std::move(target)) {
    if (!target_) throw std::invalid_argument("a speculative head needs its target model");
  }

  /// A depth's outputs: the rows its logits come from, and what the next depth (or the next
  /// draft, beyond the last depth) reads as its previous hidden state.
  struct Output {
    at::Tensor for_logits;
    at::Tensor for_next;
  };

  /// Modules run in sequence per draft; drafts beyond them chain the last one.
  virtual int64_t num_depths() const = 0;

  /// What depth 0 reads of the target's last forward, per row: from its final-norm hidden
  /// states [T, hidden] (and what the target kept: CausalLM::capture_hidden_states), [T, width].
  virtual at::Tensor target_states(const at::Tensor& hidden) = 0;

  /// Depth `depth` over rows: input_ids [R] (the token each row reads), previous [R, width]
  /// (target_states' rows at depth 0, the depth before's for_next after), positions [R], writing
  /// its K/V to kv_caches[depth] at metadata.slot_mapping.
  virtual Output forward_depth(int64_t depth, const at::Tensor& input_ids,
                               const at::Tensor& previous, const at::Tensor& positions,
                               const AttentionMetadata& metadata,
                               const std::vector<LayerKVCache>& kv_caches) = 0;

  /// Not available: a head needs the target's hidden states (forward_depth). Throws.
  at::Tensor forward(const at::Tensor&, const at::Tensor&, const AttentionMetadata&,
                     const std::vector<LayerKVCache>&) override {
    throw std::invalid_argument(
        "a speculative head reads the target's hidden states: it runs through forward_depth");
  }
  at::ScalarType dtype() const override { return target_->dtype(); }
  at::Device device() const override { return target_->device(); }

 protected:
  std::shared_ptr<CausalLM> target_;
};

}  // namespace kvserve
