// The local communicator, and one over a torch.distributed (c10d) process group.
#include "kvserve/communicator.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>

#include <stdexcept>
#include <vector>

#ifdef USE_DISTRIBUTED
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace kvserve {
namespace {

// Collectives read and write the tensor's storage as one dense block.
void check_dense(const at::Tensor& tensor, const char* what) {
  if (!tensor.defined() || !tensor.is_contiguous()) {
    throw std::invalid_argument(std::string("communicator: ") + what +
                                " needs a defined, contiguous tensor");
  }
}

void check_root(int64_t root, int64_t size) {
  if (root < 0 || root >= size) {
    throw std::invalid_argument("communicator: root " + std::to_string(root) +
                                " is not a rank of " + std::to_string(size));
  }
}

class LocalCommunicator final : public Communicator {
 public:
  int64_t rank() const override { return 0; }
  int64_t size() const override { return 1; }
  void all_reduce_(at::Tensor& tensor) override { check_dense(tensor, "all_reduce_"); }
  at::Tensor all_gather(const at::Tensor& tensor, int64_t) override { return tensor; }
  at::Tensor gather(const at::Tensor& tensor, int64_t, int64_t root) override {
    check_root(root, 1);
    return tensor;
  }
  void broadcast_(at::Tensor& tensor, int64_t root) override {
    check_root(root, 1);
    check_dense(tensor, "broadcast_");
  }
  void barrier() override {}
  std::string describe() const override { return "local"; }
};

#ifdef USE_DISTRIBUTED

class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string name)
      : group_(std::move(group)),
        name_(std::move(name)),
        gather_small_sums_(group_->getBackendName() == "gloo") {}

  int64_t rank() const override { return group_->getRank(); }
  int64_t size() const override { return group_->getSize(); }

  void all_reduce_(at::Tensor& tensor) override {
    check_dense(tensor, "all_reduce_");
    // Gloo's all-reduce takes several exchanges: 1.2 ms for 1 KiB between two processes of a
    // 2-vCPU VM, where an all-gather takes 0.56 ms. A small tensor (a decode step's activations)
    // is gathered and summed in rank order instead, which also gives every rank the same bits.
    if (gather_small_sums_ && tensor.numel() * tensor.element_size() <= kGatherSumBytes) {
      tensor.copy_(all_gather(tensor.unsqueeze(0), 0).sum(0));
      return;
    }
    std::vector<at::Tensor> tensors = {tensor};
    group_->allreduce(tensors)->wait();
  }

  at::Tensor all_gather(const at::Tensor& tensor, int64_t dim) override {
    std::vector<at::Tensor> input = {tensor.contiguous()};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int64_t r = 0; r < size(); ++r) output[0].push_back(at::empty_like(input[0]));
    group_->allgather(output, input)->wait();
    return at::cat(output[0], dim);
  }

  at::Tensor gather(const at::Tensor& tensor, int64_t dim, int64_t root) override {
    check_root(root, size());
    std::vector<at::Tensor> input = {tensor.contiguous()};
    std::vector<std::vector<at::Tensor>> output(rank() == root ? 1 : 0);
    if (rank() == root) {
      for (int64_t r = 0; r < size(); ++r) output[0].push_back(at::empty_like(input[0]));
    }
    c10d::GatherOptions options;
    options.rootRank = root;
    group_->gather(output, input, options)->wait();
    return rank() == root ? at::cat(output[0], dim) : at::Tensor();
  }

  void broadcast_(at::Tensor& tensor, int64_t root) override {
    check_root(root, size());
    check_dense(tensor, "broadcast_");
    std::vector<at::Tensor> tensors = {tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    group_->broadcast(tensors, options)->wait();
  }

  void barrier() override { group_->barrier()->wait(); }

  std::string describe() const override {
    return group_->getBackendName() + " group '" + name_ + "'";
  }

 private:
  // All-reduces of up to this many bytes go by all-gather on Gloo.
  static constexpr int64_t kGatherSumBytes = 256 * 1024;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string name_;
  bool gather_small_sums_;
};

#endif  // USE_DISTRIBUTED

}  // namespace

std::shared_ptr<Communicator> local_communicator() { return std::make_shared<LocalCommunicator>(); }

std::shared_ptr<Communicator> process_group_communicator(const std::string& group_name) {
#ifdef USE_DISTRIBUTED
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(group_name);
  } catch (const c10::Error&) {
  }
  if (!group) {
    throw std::invalid_argument("no torch.distributed process group named '" + group_name +
                                "' in this process (create it with kvserve.distributed)");
  }
  return std::make_shared<ProcessGroupCommunicator>(std::move(group), group_name);
#else
  throw std::invalid_argument("this torch has no torch.distributed: cannot use process group '" +
                              group_name + "'");
#endif
}

}  // namespace kvserve
