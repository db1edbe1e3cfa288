#pragma once
// Collectives between the ranks that run one model together (tensor parallelism). Python creates
// the process groups with torch.distributed (kvserve/distributed.py: Gloo on CPUs, NCCL between
// GPUs) and C++ resolves them by name from torch's group registry, so kvserve runs on the
// distributed runtime the ecosystem uses (torchrun, c10d stores) and has no transport of its own.
// A single rank uses the local communicator, whose collectives return their input.
//
// Every collective blocks until it is done on this rank, and every rank of the group must call
// the same collectives in the same order with tensors of the same shape and dtype (a rank that
// skips one hangs the others until the group's timeout).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

namespace kvserve {

class Communicator {
 public:
  virtual ~Communicator() = default;

  /// This process's rank in [0, size()).
  virtual int64_t rank() const = 0;
  /// Ranks in the group.
  virtual int64_t size() const = 0;

  /// Sums `tensor` over the ranks, in place: every rank ends with the sum.
  virtual void all_reduce_(at::Tensor& tensor) = 0;
  /// Every rank's `tensor` (one shape on all) concatenated along `dim` in rank order, on every
  /// rank.
  virtual at::Tensor all_gather(const at::Tensor& tensor, int64_t dim) = 0;
  /// The same concatenation on rank `root` only; the other ranks get an undefined tensor.
  virtual at::Tensor gather(const at::Tensor& tensor, int64_t dim, int64_t root) = 0;
  /// Rank `root`'s `tensor` into every rank's `tensor` (same shape and dtype), in place.
  virtual void broadcast_(at::Tensor& tensor, int64_t root) = 0;
  /// Returns once every rank has called it.
  virtual void barrier() = 0;

  /// A description for messages and logs: "local" or "<backend> group '<name>'".
  virtual std::string describe() const = 0;
};

/// One rank alone: rank 0 of 1; collectives return (or leave) their input.
std::shared_ptr<Communicator> local_communicator();

/// The torch.distributed process group registered under `group_name` (ProcessGroup.group_name
/// in Python). Throws std::invalid_argument naming the group when no such group is registered in
/// this process, or when this torch was built without distributed support.
std::shared_ptr<Communicator> process_group_communicator(const std::string& group_name);

}  // namespace kvserve
