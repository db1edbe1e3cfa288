#include "models/mtp_head.h"

#include <ATen/ops/cat.h>

#include <stdexcept>
#include <string>

#include "kvserve/communicator.h"

namespace kvserve {

MtpHead::MtpHead(ModelConfig config, std::shared_ptr<CausalLM> target, std::vector<Depth> depths)
    : DraftHead(std::move(target)), config_(std::move(config)), depths_(std::move(depths)) {
  if (depths_.empty()) throw std::invalid_argument("MtpHead: no module");
  if (config_.num_layers != num_depths()) {
    throw std::invalid_argument("MtpHead: the config has " + std::to_string(config_.num_layers) +
                                " layers for " + std::to_string(num_depths()) + " modules");
  }
  const int64_t hidden = target_->config().hidden_size;
  for (size_t d = 0; d < depths_.size(); ++d) {
    const Depth& m = depths_[d];
    const std::string which = "MtpHead: module " + std::to_string(d) + " ";
    if (!m.block || m.block->config().num_layers != 1) {
      throw std::invalid_argument(which + "needs a block of one decoder layer");
    }
    if (m.block->config().hidden_size != hidden || m.eh_proj.in_features() != 2 * hidden ||
        m.eh_proj.out_features() != hidden || m.enorm.weight().numel() != hidden ||
        m.hnorm.weight().numel() != hidden) {
      throw std::invalid_argument(which + "does not fit the target's hidden size " +
                                  std::to_string(hidden));
    }
    if (m.block->device() != target_->device() || m.block->dtype() != target_->dtype()) {
      throw std::invalid_argument(which + "is not on the target's device in its dtype");
    }
    const auto num_ranks = [](const CausalLM& model) {
      return model.ranks() ? model.ranks()->size() : 1;
    };
    if (num_ranks(*m.block) != num_ranks(*target_)) {
      throw std::invalid_argument(which + "is not split over the target's ranks");
    }
  }
}

DraftHead::Output MtpHead::forward_depth(int64_t depth, const at::Tensor& input_ids,
                                         const at::Tensor& previous, const at::Tensor& positions,
                                         const AttentionMetadata& metadata,
                                         const std::vector<LayerKVCache>& kv_caches) {
  TORCH_CHECK(depth >= 0 && depth < num_depths(), "MtpHead: no module ", depth);
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_depths(), "MtpHead: got ",
              kv_caches.size(), " caches for ", num_depths(), " modules");
  TORCH_CHECK(previous.dim() == 2 && previous.size(0) == input_ids.size(0),
              "MtpHead: previous must be [rows, hidden]");
  const Depth& m = depths_[depth];
  const at::Tensor embedded = target_->embed_inputs(input_ids);
  const at::Tensor joined = at::cat({m.enorm.forward(embedded), m.hnorm.forward(previous)}, 1);
  at::Tensor out = m.block->forward_embeds(m.eh_proj.forward(joined), positions, metadata,
                                          {kv_caches[depth]});
  return {out, out};
}

at::Tensor MtpHead::compute_logits(const at::Tensor& hidden) {
  return target_->compute_logits(hidden);
}

int64_t MtpHead::weight_bytes() const {
  int64_t bytes = 0;
  for (const Depth& m : depths_) {
    bytes += m.block->weight_bytes() + m.enorm.weight_bytes() + m.hnorm.weight_bytes() +
             m.eh_proj.weight_bytes();
  }
  return bytes;
}

}  // namespace kvserve
