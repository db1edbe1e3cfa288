#include "kvserve/cuda_graph_runner.h"

#include <algorithm>
#include <iostream>
#include <map>
#include <stdexcept>

#if KVSERVE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kvserve {

#if KVSERVE_WITH_CUDA

// One captured size: the bytes its batch is uploaded into, the batch's tensors (views of them),
// the graph, and the hidden states it writes.
struct CapturedStep {
  ForwardBatch batch;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  at::Tensor hidden;
};

struct CudaGraphRunner::Graphs {
  at::cuda::MempoolId_t pool = at::cuda::graph_pool_handle();
  std::map<int64_t, CapturedStep> steps;
};

bool CudaGraphRunner::supports(const CausalLM& model) {
  const ModelConfig& config = model.config();
  return model.device().is_cuda() &&
         (config.mla.kv_lora_rank == 0 || config.mla.attention_path != "expanded");
}

#else

struct CudaGraphRunner::Graphs {};

bool CudaGraphRunner::supports(const CausalLM&) { return false; }

#endif

CudaGraphRunner::CudaGraphRunner(CausalLM& model, int64_t max_batch, int64_t table_width)
    : model_(model), max_batch_(max_batch), table_width_(table_width),
      graphs_(std::make_unique<Graphs>()) {
  if (!supports(model)) {
    throw std::invalid_argument("CUDA graphs need a CUDA build and a model on a CUDA device "
                                "(latent attention not forced to its expanded form)");
  }
  if (max_batch < 1 || table_width < 1) {
    throw std::invalid_argument("CudaGraphRunner: max_batch and table_width must be >= 1");
  }
  for (int64_t size : {1, 2, 4}) {
    if (size < max_batch) sizes_.push_back(size);
  }
  for (int64_t size = 8; size < max_batch; size += 8) sizes_.push_back(size);
  sizes_.push_back(max_batch <= 4 ? max_batch : (max_batch + 7) / 8 * 8);
}

CudaGraphRunner::~CudaGraphRunner() = default;

int64_t CudaGraphRunner::padded_size(int64_t num_sequences) const {
  if (disabled_ || num_sequences < 1 || num_sequences > max_batch_) return 0;
  return *std::lower_bound(sizes_.begin(), sizes_.end(), num_sequences);
}

int64_t CudaGraphRunner::num_graphs() const {
#if KVSERVE_WITH_CUDA
  return static_cast<int64_t>(graphs_->steps.size());
#else
  return 0;
#endif
}

at::Tensor CudaGraphRunner::forward(const ForwardBatchBuilder& builder,
                                    const std::vector<LayerKVCache>& caches,
                                    const TokenFeed* feed) {
#if KVSERVE_WITH_CUDA
  const int64_t size = builder.num_sequences();
  if (padded_size(size) != size || builder.num_tokens() != size ||
      builder.max_table_blocks() > table_width_) {
    throw std::invalid_argument("CudaGraphRunner: not a padded decode batch of a captured size");
  }
  const at::Device device = model_.device();
  auto found = graphs_->steps.find(size);
  if (found != graphs_->steps.end()) {
    CapturedStep& step = found->second;
    builder.build(device, table_width_, step.batch.storage);
    if (feed) feed->apply(step.batch.input_ids);
    step.graph->replay();
    return step.hidden;
  }
  // First step of this size: an eager forward (its result is this step's), then the capture on
  // a side stream, ordered after the caller's stream and before its next work.
  CapturedStep step;
  step.batch = builder.build(device, table_width_);
  if (feed) feed->apply(step.batch.input_ids);
  const ForwardBatch& batch = step.batch;
  at::Tensor hidden = model_.forward(batch.input_ids, batch.positions, batch.metadata, caches);
  const c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  c10::Event before(c10::DeviceType::CUDA), after(c10::DeviceType::CUDA);
  before.record(caller);
  before.block(side);
  bool captured = false;
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    step.graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      step.graph->capture_begin(graphs_->pool);
      step.hidden = model_.forward(batch.input_ids, batch.positions, batch.metadata, caches);
      step.graph->capture_end();
      captured = true;
    } catch (const std::exception& e) {
      // The eager forward above ran, so this step has its result; later steps run eagerly.
      std::cerr << "kvserve: capturing a CUDA graph failed, decoding without graphs: "
                << e.what() << "\n";
      disabled_ = true;
    }
  }
  after.record(side);
  after.block(caller);
  if (captured) graphs_->steps.emplace(size, std::move(step));
  return hidden;
#else
  (void)builder;
  (void)caches;
  (void)feed;
  throw std::logic_error("CudaGraphRunner: this build has no CUDA");
#endif
}

}  // namespace kvserve
